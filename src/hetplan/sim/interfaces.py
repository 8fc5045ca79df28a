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
    transfers interface p carries one group after the other (None: served as issued)."""

    def __init__(self, ports: Sequence[tuple[int, ...]], needs: Sequence[tuple[float, ...]],
                 capacity: Sequence[float], turns: Sequence[list[list[int]] | None]) -> None:
        self.ports, self.needs, self.turns = ports, needs, turns
        self.free = list(capacity)  # bandwidth not in use
        self.slack = [c * 1e-9 for c in capacity]  # so that n transfers of capacity / n fit
        self.queue: list[deque[int]] = [deque() for _ in capacity]  # waiting, in the order issued
        self.started = [False] * len(ports)
        self.issued = [False] * len(ports)
        self.turn = [0] * len(capacity)  # on an interface with turns, the group whose turn it is
        self.group = [0] * len(ports)  # a transfer's group on the interface with turns of its path
        self.left = [[len(g) for g in groups] if groups is not None else [] for groups in turns]
        for groups in turns:
            for k, members in enumerate(groups or ()):
                for x in members:
                    self.group[x] = k

    def can_start(self, x: int) -> bool:
        """Every interface on x's path has room for it, and it is x's turn on those with turns."""
        free, slack, turns, turn = self.free, self.slack, self.turns, self.turn
        for p, need in zip(self.ports[x], self.needs[x], strict=True):
            if need > free[p] + slack[p] or (turns[p] is not None and self.group[x] != turn[p]):
                return False
        return True

    def issue(self, x: int) -> bool:
        """Transfer x is ready to go: True if it starts now (taken), else it waits."""
        self.issued[x] = True
        if self.can_start(x):
            self._take(x)
            return True
        for p in self.ports[x]:
            if self.turns[p] is None:
                self.queue[p].append(x)
        return False

    def release(self, x: int) -> list[int]:
        """Transfer x ended: the transfers that start now in its place (taken)."""
        free, turns = self.free, self.turns
        for p, need in zip(self.ports[x], self.needs[x], strict=True):
            free[p] += need
            if turns[p] is not None:
                left = self.left[p]
                left[self.group[x]] -= 1
                if not left[self.group[x]]:
                    self.turn[p] += 1
        out: list[int] = []
        for p in self.ports[x]:
            if turns[p] is not None or self.queue[p]:
                self._next_on(p, out)
        return out

    def _take(self, x: int) -> None:
        self.started[x] = True
        for p, need in zip(self.ports[x], self.needs[x], strict=True):
            self.free[p] -= need

    def _next_on(self, port: int, out: list[int]) -> None:
        """Take what can start on `port` (into `out`): of the group whose turn it is, or on an
        interface served as issued, of the transfers waiting, in order."""
        groups, started, issued = self.turns[port], self.started, self.issued
        if groups is not None:
            k = self.turn[port]
            waiting = groups[k] if k < len(groups) else ()
        else:
            waiting = self.queue[port]
            while waiting and started[waiting[0]]:
                waiting.popleft()
            waiting = tuple(waiting)
        for x in waiting:
            if issued[x] and not started[x] and self.can_start(x):
                self._take(x)
                out.append(x)
