from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import HetplanError
from hetplan.schedule import (
    SCHEDULES,
    Action,
    gpipe,
    inflight_microbatches,
    one_f_one_b,
    peak_in_flight,
    schedule_order,
)


def torch_order(cls, stages, microbatches):
    """torch's own order for a schedule class, without idle slots and gradient reductions."""
    order = cls._get_pipeline_order(SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches))
    return tuple(tuple(str(a) for a in order[r] if a is not None and str(a)[len(str(r))] in "FB")
                 for r in range(stages))


def torch_class(name):
    """The torch.distributed.pipelining class hetplan.schedule says runs the same order."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[name].torch_class)


def test_every_schedule_names_a_torch_class_and_its_own_order():
    for name, kind in SCHEDULES.items():
        assert kind.name == name and torch_class(name).__name__ == kind.torch_class
        assert schedule_order(name, 3, 4) == kind.order(3, 4)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5, 8, 12])
def test_gpipe_matches_torch(stages, microbatches):
    ours = tuple(tuple(str(a) for a in stage) for stage in gpipe(stages, microbatches))
    assert ours == torch_order(torch_class("gpipe"), stages, microbatches)


def executed_1f1b(stages, microbatches, r):
    """The order Schedule1F1B._step_microbatches runs on stage r: min(m, n - r) forwards,
    then backward and forward in turn, then the remaining backwards."""
    warmup = min(microbatches, stages - r)
    out = [f"{r}F{i}" for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(f"{r}B{bwd}")
        bwd += 1
        if fwd == microbatches:
            break
        out.append(f"{r}F{fwd}")
        fwd += 1
    out += [f"{r}B{i}" for i in range(bwd, microbatches)]
    return tuple(out)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5, 8, 12])
def test_1f1b_matches_torch(stages, microbatches):
    ours = tuple(tuple(str(a) for a in stage) for stage in one_f_one_b(stages, microbatches))
    assert ours == tuple(executed_1f1b(stages, microbatches, r) for r in range(stages))
    if microbatches >= stages:
        # torch's printable order (_get_pipeline_order) agrees on every stage but the last, where
        # it numbers the forward passes from 1 (1F1 .. 1Fm): an off-by-one in that description
        # only, since the executed order above starts at F0.
        assert ours[:-1] == torch_order(torch_class("1f1b"), stages, microbatches)[:-1]


def test_a_known_1f1b_order():
    assert [str(a) for a in one_f_one_b(4, 6)[1]] == [
        "1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"]


def torch_zero_bubble(stages, microbatches):
    """ScheduleInterleavedZeroBubble's order with one stage per rank, idle slots left out."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    rounds = max(1, microbatches // stages)
    out = []
    for r in range(stages):
        fake = SimpleNamespace(n_local_stages=1, pp_group_size=stages, microbatches_per_round=microbatches // rounds,
                               _n_microbatches=microbatches)
        ops = ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r)
        out.append(tuple(str(a) for a in ops if a is not None))
    return tuple(out)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5, 8, 12])
def test_zero_bubble_matches_torch(stages, microbatches):
    ours = tuple(tuple(str(a) for a in stage) for stage in schedule_order("zero-bubble", stages, microbatches))
    assert ours == torch_zero_bubble(stages, microbatches)


def test_a_known_zero_bubble_order():
    assert [str(a) for a in schedule_order("zero-bubble", 4, 6)[1]] == [
        "1F0", "1F1", "1F2", "1I0", "1F3", "1I1", "1W0", "1F4", "1I2", "1W1", "1F5", "1I3", "1W2", "1I4", "1W3",
        "1I5", "1W4", "1W5"]


@given(st.integers(1, 8), st.integers(1, 32), st.sampled_from(list(SCHEDULES)))
def test_every_action_once_forward_first_and_memory_as_the_cost_model_says(stages, microbatches, schedule):
    orders = schedule_order(schedule, stages, microbatches)
    kinds = SCHEDULES[schedule].backward_kinds
    assert len(orders) == stages
    for r, actions in enumerate(orders):
        assert sorted(actions) == sorted([Action(r, k, i) for k in ("F", *kinds) for i in range(microbatches)])
        done: dict[int, list[str]] = {i: [] for i in range(microbatches)}
        for a in actions:
            done[a.microbatch].append(a.kind)
        assert all(seq == ["F", *kinds] for seq in done.values())  # F, then B (or I, then W)
        # Backward passes run in micro-batch order, as torch runs them.
        for kind in kinds:
            assert [a.microbatch for a in actions if a.kind == kind] == list(range(microbatches))
        assert peak_in_flight(actions) == inflight_microbatches(schedule, stages, r, microbatches)


def test_action_text_round_trips_and_bad_input():
    assert str(Action.parse("12B3")) == "12B3" and Action.parse("0F1") == Action(0, "F", 1)
    assert Action.parse("2W7") == Action(2, "W", 7) and str(Action(1, "I", 0)) == "1I0"
    with pytest.raises(HetplanError, match="cannot read action 'xF1'"):
        Action.parse("xF1")
    with pytest.raises(HetplanError, match="schedule 'zigzag' is unknown"):
        schedule_order("zigzag", 2, 2)
    with pytest.raises(HetplanError, match="stages >= 1"):
        gpipe(0, 4)
