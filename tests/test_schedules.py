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
    rank_orders,
    schedule_order,
    stage_ranks,
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
        if not kind.interleaved:
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


def torch_interleaved(ranks, per_rank, microbatches):
    """ScheduleInterleaved1F1B's order per rank, idle slots left out."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, microbatches // ranks)
    out = []
    for r in range(ranks):
        fake = SimpleNamespace(n_local_stages=per_rank, pp_group_size=ranks,
                               microbatches_per_round=microbatches // rounds, _n_microbatches=microbatches)
        ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r)
        out.append(tuple(str(a) for a in ops if a is not None))
    return tuple(out)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("per_rank", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6, 8, 12])
def test_interleaved_1f1b_matches_torch(ranks, per_rank, microbatches):
    stages = ranks * per_rank
    problem = SCHEDULES["interleaved-1f1b"].problem(stages, ranks, microbatches)
    if problem:  # torch's __init__ refuses these too
        assert "rounds" in problem and microbatches % max(1, microbatches // ranks)
        return
    ours = tuple(tuple(str(a) for a in rank) for rank in rank_orders("interleaved-1f1b", stages, microbatches, ranks))
    assert ours == torch_interleaved(ranks, per_rank, microbatches)


def test_a_known_interleaved_order_and_its_refusals():
    assert [str(a) for a in rank_orders("interleaved-1f1b", 4, 4, 2)[1]] == [
        "1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2", "3F3", "3B3", "1B2", "1B3"]
    # the deadlock check can fail: rank 0 waiting for 2F0 before running 0F0 never finishes
    bad = rank_orders("interleaved-1f1b", 4, 4, 2)
    assert not runs_to_the_end((tuple(sorted(bad[0], key=lambda a: a.stage != 2)), bad[1]), 4)
    with pytest.raises(HetplanError, match="a multiple of n stages"):
        rank_orders("interleaved-1f1b", 5, 4, 2)
    with pytest.raises(HetplanError, match="5 micro-batches in 2 rounds"):
        rank_orders("interleaved-1f1b", 4, 5, 2)
    with pytest.raises(HetplanError, match="one stage per rank"):
        rank_orders("1f1b", 4, 4, 2)


def torch_zbv(ranks, microbatches):
    """ScheduleZBVZeroBubble's order per rank, idle slots left out, and its stage-to-rank map."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, generate_stage_to_rank_mapping

    fake = SimpleNamespace(pp_group_size=ranks, num_stages=2 * ranks, _n_microbatches=microbatches)
    orders = tuple(tuple(str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
                         if a is not None) for r in range(ranks))
    mapping = generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
    return orders, tuple(mapping[s] for s in range(2 * ranks))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 5, 7, 8, 12])
def test_zbv_matches_torch(ranks, microbatches):
    ours = tuple(tuple(str(a) for a in rank) for rank in rank_orders("zb-v", 2 * ranks, microbatches, ranks))
    assert (ours, stage_ranks("zb-v", 2 * ranks, ranks)) == torch_zbv(ranks, microbatches)


def test_a_known_zbv_order_and_its_refusal():
    assert [str(a) for a in rank_orders("zb-v", 4, 4, 2)[1]] == [
        "1F0", "2F0", "1F1", "2F1", "2I0", "2W0", "1F2", "1I0", "1W0", "2F2", "2I1", "2W1", "1F3", "1I1", "1W1",
        "2F3", "2I2", "2W2", "1I2", "2I3", "1I3", "1W2", "2W3", "1W3"]
    assert stage_ranks("zb-v", 6, 3) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(HetplanError, match="ZB-V puts two stages on each rank"):
        rank_orders("zb-v", 6, 4, 2)


def runs_to_the_end(orders, stages):
    """Whether ranks that run their lists in order, each action waiting for its input (blocking
    receives, sends that never block), all finish."""
    done, ptr = set(), [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while ptr[r] < len(order):
                a = order[ptr[r]]
                if a.kind == "F":
                    need = (a.stage - 1, "F")
                elif a.kind == "W":
                    need = (a.stage, "I")
                else:  # B or I: the gradients from the stage after, or the loss on the last stage
                    need = (a.stage + 1, a.kind) if a.stage < stages - 1 else (a.stage, "F")
                if need[0] >= 0 and (*need, a.microbatch) not in done:
                    break
                done.add((a.stage, a.kind, a.microbatch))
                ptr[r] += 1
                progress = True
    return all(p == len(o) for p, o in zip(ptr, orders, strict=True))


@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 24), st.sampled_from(list(SCHEDULES)))
def test_every_action_once_forward_first_deadlock_free_and_memory_as_the_cost_model_says(
        ranks, per_rank, microbatches, schedule):
    sched = SCHEDULES[schedule]
    stages = ranks * per_rank if sched.interleaved else ranks
    if sched.problem(stages, ranks, microbatches):
        assert sched.interleaved  # the others run any micro-batches on one stage per rank
        return
    per_rank_orders = rank_orders(schedule, stages, microbatches, ranks)
    holder = stage_ranks(schedule, stages, ranks)
    assert all(holder[a.stage] == r for r, order in enumerate(per_rank_orders) for a in order)
    assert runs_to_the_end(per_rank_orders, stages)
    orders = schedule_order(schedule, stages, microbatches, ranks)
    kinds = sched.backward_kinds
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
        assert peak_in_flight(actions) == inflight_microbatches(schedule, stages, r, microbatches, ranks)


def test_action_text_round_trips_and_bad_input():
    assert str(Action.parse("12B3")) == "12B3" and Action.parse("0F1") == Action(0, "F", 1)
    assert Action.parse("2W7") == Action(2, "W", 7) and str(Action(1, "I", 0)) == "1I0"
    with pytest.raises(HetplanError, match="cannot read action 'xF1'"):
        Action.parse("xF1")
    with pytest.raises(HetplanError, match="schedule 'zigzag' is unknown"):
        schedule_order("zigzag", 2, 2)
    with pytest.raises(HetplanError, match="stages >= 1"):
        gpipe(0, 4)
