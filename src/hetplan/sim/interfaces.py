"""How the transfers of a simulated step share the network's interfaces (`Cluster.interfaces`).

A transfer runs at its link's bandwidth (`Cluster.link`) and holds that much of every interface
on its path (all of it, if the interface is slower: `Cluster.interface_Bps`) for its whole
duration. It starts when every interface on its path has that much free and it is its turn on
each. Transfers that do not fit on an interface together take turns on it, which is how they
share its bandwidth: the last of n equal transfers ends after n times one's duration, as with a
fair share (one sender feeding two replicas; two devices of a host sending to another host
through one network interface).

Turns: the receiving side of a device that holds one stage replica takes the inputs of its
actions in the order of its actions, one action's inputs after the other's, as hetplan's runtime
receives (blocking, in action order). Every other interface (sending sides, hosts' network
interfaces, devices that hold several stages) serves the transfers waiting for it in the order
they were issued, the first that fits. A transfer holds nothing while it waits, and an action's
inputs never depend on a later action of the same device (the schedules' orders are free of
cycles), so the step always finishes (`tests/test_interfaces.py` runs random plans of every
shape).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class Interfaces:
    """The interfaces of one step: what each transfer takes of each, what is free, whose turn it
    is and who waits. Transfers and interfaces are numbered; `ports[x]` and `needs[x]` are the
    interfaces of transfer x and the bandwidth it takes of each, `turns[p]` the groups of
    transfers interface p carries one group after the other (None: served as issued).

    A transfer issued before its group's turn waits for the turn only; once in turn, it starts
    if every interface on its path has room, else it queues at each of them (so a transfer
    queued anywhere is always in turn, and a release looks only at what could start)."""

    def __init__(self, ports: Sequence[tuple[int, ...]], needs: Sequence[tuple[float, ...]],
                 capacity: Sequence[float], turns: Sequence[list[list[int]] | None]) -> None:
        self.ports, self.needs, self.turns = ports, needs, turns
        self.free = list(capacity)  # bandwidth not in use
        self.slack = [c * 1e-9 for c in capacity]  # so that n transfers of capacity / n fit
        self.queue: list[deque[int]] = [deque() for _ in capacity]  # in turn and waiting, in the order issued
        self.pending = [0] * len(capacity)  # how many of those are still waiting
        self.state = [NEW] * len(ports)
        self.turn = [0] * len(capacity)  # on an interface with turns, the group whose turn it is
        self.turn_port = [-1] * len(ports)  # the interface with turns on a transfer's path, or -1
        self.group = [0] * len(ports)  # its group there
        self.left = [[len(g) for g in groups] if groups is not None else [] for groups in turns]
        for p, groups in enumerate(turns):
            for k, members in enumerate(groups or ()):
                for x in members:
                    self.group[x], self.turn_port[x] = k, p

    def issue(self, x: int) -> bool:
        """Transfer x is ready to go: True if it starts now, else it waits (for its turn, or
        for room)."""
        t = self.turn_port[x]
        if t >= 0 and self.group[x] != self.turn[t]:
            self.state[x] = AWAITING_TURN
            return False
        return self._start_or_queue(x)

    def release(self, x: int) -> list[int]:
        """Transfer x ended: the transfers that start now in its place."""
        free, out, ports = self.free, [], self.ports[x]
        for p, need in zip(ports, self.needs[x]):  # noqa: B905 (same lengths by construction; hot loop)
            free[p] += need
        t = self.turn_port[x]
        if t >= 0:
            left, k = self.left[t], self.group[x]
            left[k] -= 1
            if not left[k]:
                self.turn[t] = k + 1
                groups = self.turns[t]
                for y in groups[k + 1] if k + 1 < len(groups) else ():
                    if self.state[y] == AWAITING_TURN and self._start_or_queue(y):
                        out.append(y)
        pending = self.pending
        for p in ports:
            if pending[p]:
                self._next_on(p, out)
        return out

    def _fits(self, x: int) -> bool:
        free, slack = self.free, self.slack
        return all(need <= free[p] + slack[p] for p, need in zip(self.ports[x], self.needs[x]))  # noqa: B905

    def _start_or_queue(self, x: int) -> bool:
        if self._fits(x):
            self._hold(x)
            return True
        self.state[x] = QUEUED
        for p in self.ports[x]:
            self.pending[p] += 1
            self.queue[p].append(x)
        return False

    def _hold(self, x: int) -> None:
        self.state[x] = STARTED
        for p, need in zip(self.ports[x], self.needs[x]):  # noqa: B905 (hot loop)
            self.free[p] -= need

    def _next_on(self, port: int, out: list[int]) -> None:
        """Start (into `out`) the transfers queued at `port` that fit now, in the order issued."""
        queue, state, free, slack = self.queue[port], self.state, self.free, self.slack
        while queue and state[queue[0]] == STARTED:
            queue.popleft()
        for x in queue:  # not changed below: starting a transfer only marks it
            if free[port] <= slack[port]:
                return
            if state[x] == QUEUED and self._fits(x):
                self._hold(x)
                for p in self.ports[x]:
                    self.pending[p] -= 1
                out.append(x)


NEW, AWAITING_TURN, QUEUED, STARTED = range(4)
