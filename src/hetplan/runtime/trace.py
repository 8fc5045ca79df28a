"""The measured timeline of a run (`hetplan run --trace`), in the simulator's format.

Each worker records its last step (`hetplan.runtime.worker.step_trace`): every forward and
backward action of its stage replica (receiving its inputs included, as the executor runs them),
every message it received (the wait and the copy, drawn on the link from the sender's device),
its share of the gradient all-reduce and its optimizer step, on the time.perf_counter clock from
the moment the workers left the step's first barrier. `measured_timeline` gathers the workers'
records into a `hetplan.timeline.Timeline`, so that the Gantt chart and the Chrome trace
of a run and of the simulator's prediction are drawn alike (`hetplan.timeline.gantt`).
What is not recorded: sends (posted without waiting; their cost shows in the receiver's wait).
"""

from __future__ import annotations

from hetplan.runtime.launch import RunResult
from hetplan.runtime.spec import RunSpec
from hetplan.timeline import Span, Timeline


def measured_timeline(result: RunResult, spec: RunSpec) -> Timeline:
    """The last step of a traced run, as a Timeline (devices in rank order, then links)."""
    device_of = {k: me.device for k, me in enumerate(spec.ranks)}
    spans, links = [], []
    for rank in result.ranks:
        me = device_of[rank["rank"]]
        for kind, stage, mb, start, end, src in rank.get("trace", ()):
            if src < 0:
                spans.append(Span(me, kind, stage, mb, start, end))
                continue
            link = f"{device_of[src]}->{me}"
            if link not in links:
                links.append(link)
            # a message's stage is the sender's (the executor records the peer's stage); activations
            # go to the stage after it, gradients to the one before
            spans.append(Span(link, kind, stage, mb, start, end, stage + 1 if kind == "F" else stage - 1))
    devices = tuple(dict.fromkeys(device_of[k] for k in range(len(spec.ranks))))
    step = max((s.end_s for s in spans), default=0.0)
    return Timeline(tuple(spans), devices, tuple(links), step)
