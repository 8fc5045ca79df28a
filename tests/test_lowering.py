"""The step lowered to each worker's list of passes, messages and sums (`hetplan.lowering`): exact
lists for small plans, a dry run that pairs every message and never deadlocks on any schedule,
replica split or tensor-parallel group, and finds the broken lists it is there to find; and the
executor sends and receives, rank by rank, what the lists say, in their order (its messages pair
by that order alone: `test_executor.run_checked`, for every plan the executor's tests run)."""

import json
import re
from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hetplan.errors import HetplanError
from hetplan.lowering import (
    RECEIVES,
    RECV_F,
    REDUCE_GRAD,
    SEND_F,
    SENDS,
    STEP,
    Lowered,
    Op,
    check_lowered,
    dry_run,
    lower,
)
from hetplan.rows import step_rows
from hetplan.schedule import SCHEDULES, get_schedule, rank_orders, stage_ranks


def chain(schedule, replicas, m, batch=8, weights=None, tp=None, ranks=None):
    """The lists of a chain plan: stage k has replicas[k] replicas (tp[k] ranks each), numbered
    stage by stage; under an interleaved schedule `ranks` pipeline ranks hold the stages; a
    replicated stage's replicas (their groups' first ranks) sum their gradients, stage by stage."""
    n = len(replicas)
    holder = stage_ranks(schedule, n, ranks)
    groups, numbers = [], {}
    for k in range(n):
        if holder[k] in numbers:  # an interleaved rank's later stage: the same workers
            groups.append(numbers[holder[k]])
            continue
        start = 1 + max((r for reps in groups for g in reps for r in g), default=-1)
        size = (tp or [1] * n)[k]
        reps = [tuple(range(start + p * size, start + (p + 1) * size)) for p in range(replicas[k])]
        numbers[holder[k]] = reps
        groups.append(reps)
    rows = step_rows(batch, m, weights or [[1.0] * r for r in replicas])
    sums = list(dict.fromkeys(tuple(g[0] for g in reps) for reps in groups if len(reps) > 1))
    return lower(schedule, groups, holder, rows, sums), groups


def test_two_stages_under_gpipe_exactly():
    lowered, _ = chain("gpipe", [1, 1], 2, batch=4)
    assert lowered.lines() == [
        "rank 0: 0F0 0SEND_F0->1 0F1 0SEND_F1->1 0RECV_B0<-1 0B0 0RECV_B1<-1 0B1 0STEP",
        "rank 1: 1RECV_F0<-0 1F0 1RECV_F1<-0 1F1 1B0 1SEND_B0->0 1B1 1SEND_B1->0 1STEP"]
    assert dry_run(lowered) == []


def test_replicas_get_their_rows_and_sum_their_gradients():
    """2 + 1 replicas, 3 rows a micro-batch split 2:1 by speed: stage 0's replicas each send their
    rows to stage 1's one replica, which sends each its gradients back; they then sum."""
    rows = step_rows(6, 2, [[2.0, 1.0], [1.0]])
    lowered = lower("1f1b", [[(0,), (1,)], [(2,)]], [0, 1], rows, sums=[(0, 1)])
    assert lowered.lines() == [
        "rank 0: 0F0 0SEND_F0->2[0:2] 0F1 0SEND_F1->2[0:2] 0RECV_B0<-2[0:2] 0B0 0RECV_B1<-2[0:2] 0B1 "
        "0REDUCE_GRAD(0,1) 0STEP",
        "rank 1: 0F0 0SEND_F0->2[2:3] 0F1 0SEND_F1->2[2:3] 0RECV_B0<-2[2:3] 0B0 0RECV_B1<-2[2:3] 0B1 "
        "0REDUCE_GRAD(0,1) 0STEP",
        "rank 2: 1RECV_F0<-0[0:2] 1RECV_F0<-1[2:3] 1F0 1B0 1SEND_B0->0[0:2] 1SEND_B0->1[2:3] "
        "1RECV_F1<-0[0:2] 1RECV_F1<-1[2:3] 1F1 1B1 1SEND_B1->0[0:2] 1SEND_B1->1[2:3] 1STEP"]
    assert dry_run(lowered) == []


def test_a_tensor_parallel_groups_first_rank_sends_to_every_rank_of_the_next():
    lowered, _ = chain("gpipe", [1, 1, 1], 1, batch=2, tp=[2, 1, 2])
    assert lowered.lines() == [
        "rank 0: 0F0 0SEND_F0->2 0RECV_B0<-2 0B0 0STEP",
        "rank 1: 0F0 0RECV_B0<-2 0B0 0STEP",
        "rank 2: 1RECV_F0<-0 1F0 1SEND_F0->3 1SEND_F0->4 1RECV_B0<-3 1B0 1SEND_B0->0 1SEND_B0->1 1STEP",
        "rank 3: 2RECV_F0<-2 2F0 2B0 2SEND_B0->2 2STEP",
        "rank 4: 2RECV_F0<-2 2F0 2B0 2STEP"]
    assert dry_run(lowered) == []


def test_a_replica_without_rows_of_a_microbatch_runs_nothing_for_it():
    """3 rows a micro-batch over 4 replicas: one of them has none, and gets no message."""
    lowered, groups = chain("1f1b", [1, 4], 2, batch=6)
    idle = [r for r in (g[0] for g in groups[1]) if not any(op.microbatch == 0 for op in lowered.ops[r])]
    assert len(idle) == 1
    assert not any(op.peer == idle[0] and op.microbatch == 0 for op in lowered.ops[0])
    assert dry_run(lowered) == []


def test_zb_v_pairs_only_with_one_channel_each_way():
    """Under ZB-V rank 0 sends stage 0's activations of micro-batch 2 before stage 3's gradients
    of micro-batch 0, which rank 1 takes first: on one channel per pair they would cross."""
    lowered, _ = chain("zb-v", [1, 1, 1, 1], 4, ranks=2)
    sends = [str(op) for op in lowered.ops[0] if op.kind in SENDS and op.peer == 1]
    got = [str(op) for op in lowered.ops[1] if op.kind in RECEIVES and op.peer == 0]
    assert sends.index("0SEND_F2->1") < sends.index("3SEND_B0->1")
    assert got.index("2RECV_B0<-0") < got.index("1RECV_F2<-0")
    assert dry_run(lowered) == []


SHAPES = [(name, n, ranks) for name in SCHEDULES for n, ranks in ((1, None), (2, None), (4, None), (4, 2), (6, 3))
          if get_schedule(name).problem(n, ranks or n, 4) is None]


@pytest.mark.parametrize("schedule,stages,ranks", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_every_schedule_pairs_and_finishes(schedule, stages, ranks, m):
    if get_schedule(schedule).problem(stages, ranks or stages, m):
        pytest.skip("the schedule cannot run this many micro-batches here")
    lowered, _ = chain(schedule, [1] * stages, m, batch=16, ranks=ranks)
    assert dry_run(lowered) == []
    computed = [[str(op) for op in ops if op.kind in "FBIW"] for ops in lowered.ops]
    assert computed == [[str(a) for a in order] for order in rank_orders(schedule, stages, m, ranks)]


@given(st.data())
def test_random_replicas_speeds_and_groups_pair_and_finish(data):
    """Every schedule, interleaved ones too: random replicas of random speeds per worker,
    tensor-parallel groups, micro-batches and batch sizes (a replica may get no row)."""
    schedule = data.draw(st.sampled_from(sorted(SCHEDULES)))
    ranks = data.draw(st.integers(2, 3)) if get_schedule(schedule).interleaved else None
    n = (2 * ranks if schedule == "zb-v" else ranks * data.draw(st.integers(1, 2))) if ranks else data.draw(
        st.integers(1, 4))
    m = data.draw(st.integers(1, 6))
    assume(get_schedule(schedule).problem(n, ranks or n, m) is None)
    holder = stage_ranks(schedule, n, ranks)
    per_worker = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    tp_worker = data.draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    replicas = [per_worker[holder[k]] for k in range(n)]
    tp = [tp_worker[holder[k]] for k in range(n)]
    weights = [data.draw(st.lists(st.floats(0.5, 4.0), min_size=r, max_size=r)) for r in replicas]
    lowered, groups = chain(schedule, replicas, m, batch=data.draw(st.integers(m, 12)), weights=weights, tp=tp,
                            ranks=ranks)
    assert dry_run(lowered) == []
    # each rank ends with its steps, after the sums it takes part in, each once
    for ops in lowered.ops:
        tail = [op.kind for op in ops if op.kind in (REDUCE_GRAD, STEP)]
        assert tail and tail[-1] == STEP and tail == sorted(tail, key=lambda kind: kind == STEP)
    for reps in groups:
        members = tuple(g[0] for g in reps)
        if len(members) > 1:
            assert all(sum(op.group == members for op in lowered.ops[r]) == 1 for r in members)


def with_op(lowered: Lowered, rank: int, ops) -> Lowered:
    lists = list(lowered.ops)
    lists[rank] = tuple(ops)
    return Lowered(tuple(lists), lowered.micro, lowered.groups)


def test_the_dry_run_finds_crossed_missing_extra_and_mismatched_ops():
    lowered, _ = chain("gpipe", [1, 1], 2, batch=4)
    ops = list(lowered.ops[0])
    crossed = ops[:1] + [ops[2], ops[1]] + ops[3:]  # F1 before SEND_F0: fine, the order of sends holds
    assert dry_run(with_op(lowered, 0, crossed)) == []
    swapped = [ops[0], ops[2], ops[3], ops[1]] + ops[4:]  # SEND_F1 before SEND_F0
    assert dry_run(with_op(lowered, 0, swapped)) == ["rank 1's 1RECV_F0<-0 (op 0) gets rank 0's 0SEND_F1->1"]
    missing = [op for op in ops if str(op) != "0SEND_F1->1"]
    assert dry_run(with_op(lowered, 0, missing)) == [
        "the lists deadlock: rank 0 waits at 0RECV_B0<-1 (op 3); rank 1 waits at 1RECV_F1<-0 (op 2)"]
    extra = ops + [Op("SEND_F", 0, 1, 1, (0, 2))]
    assert dry_run(with_op(lowered, 0, extra)) == ["0SEND_F1->1 from rank 0 is never received by rank 1"]
    crossed_sums = Lowered((( Op(REDUCE_GRAD, 0, group=(0, 1)),), (Op(REDUCE_GRAD, 0, group=(1, 2)),),
                            (Op(REDUCE_GRAD, 0, group=(1, 2)),)), (1,))
    assert dry_run(crossed_sums) == ["rank 0 sums over (0, 1) while rank 1 sums over (1, 2)"]
    with pytest.raises(HetplanError, match="the plan's step cannot run as lowered: the lists deadlock"):
        check_lowered(with_op(lowered, 0, missing))


def test_simulate_prints_each_workers_list_of_the_readmes_plan(cli, profiles, tmp_path):
    """The README's plan (resnet50 on hetero-4): every worker's line, its sends and receives
    naming the rank at the other end, the replicated stage's rows, its sum and its step."""
    graph, plan = tmp_path / "r50.json", tmp_path / "plan.json"
    assert cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", graph).code == 0
    assert cli("plan", graph, "--cluster", "hetero-4", "-o", plan).code == 0
    res = cli("simulate", plan, "--graph", graph, "--cluster", "hetero-4", "--actions")
    assert res.code == 0, res.err
    lines = [line for line in res.out.splitlines() if line.startswith("rank ")]
    stages = json.loads(plan.read_text())["stages"]
    assert len(lines) == sum(len(s["devices"]) for s in stages)
    assert all(line.split()[-1].endswith("STEP") for line in lines)
    assert any("SEND_F0->" in line for line in lines) and any("RECV_F0<-" in line for line in lines)
    assert any("RECV_B0<-" in line for line in lines) and any("SEND_B0->" in line for line in lines)
    for line in lines:  # a replicated stage's workers sum their gradients, the others sum nothing
        stage = int(re.match(r"rank \d+: (\d+)", line)[1])
        assert ("REDUCE_GRAD(" in line) == (len(stages[stage]["devices"]) > 1), line[:80]
    as_json = cli("simulate", plan, "--graph", graph, "--cluster", "hetero-4", "--actions", "--json").json()
    assert [" ".join(ops) for ops in as_json["actions"]] == [line.split(": ", 1)[1] for line in lines]


def test_a_run_of_a_schedule_whose_lists_deadlock_is_refused_before_any_worker_starts(monkeypatch, tmp_path):
    """A schedule of a test's own whose first stage waits for micro-batch 0's gradients before it
    sends micro-batch 1, which the second stage needs first: `run_spec` refuses it in one line."""
    from hetplan import schedule as schedule_module
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.plan import Plan, Stage
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.settings import RunSettings
    from hetplan.schedule import Action, Schedule

    def crossed(stages, m):
        return ((Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)),
                (Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)))

    monkeypatch.setitem(schedule_module.SCHEDULES, "crossed", Schedule("crossed", crossed, lambda s, i, m: m, False,
                                                                       "ScheduleGPipe", "a test's"))
    cluster = cluster_from_spec({"name": "two", "devices": [
        {"id": d, "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for d in ("a", "b")]}, "two")
    plan = Plan((Stage(("x",), ("a",)), Stage(("y",), ("b",))), 2, "crossed", "test")
    settings = RunSettings(batch_size=4, seq_len=16, granularity="layer", out_dir=tmp_path)
    with pytest.raises(HetplanError, match=r"cannot run as lowered: the lists deadlock: rank 0 waits at "
                                           r"0RECV_B0<-1 \(op 2\); rank 1 waits at 1RECV_F1<-0 \(op 2\)"):
        run_spec(plan, cluster, "mlp", settings)
    assert list(tmp_path.iterdir()) == []


def test_a_heartbeat_says_where_a_worker_is_in_words():
    from hetplan.lowering import BARRIER, SUMS, describe

    assert describe("2RECV_F13<-5") == "waiting at 2RECV_F13<-5 for micro-batch 13's activations from worker 5"
    assert describe("0RECV_B0<-1") == "waiting at 0RECV_B0<-1 for micro-batch 0's gradients from worker 1"
    assert describe(str(Op("F", 1, 3))) == "running 1F3"
    assert describe(BARRIER) == "waiting for every worker at a step's start or end"
    assert describe(SUMS) == "in its optimizer step, after its gradient sums"
    assert describe(str(Op(REDUCE_GRAD, 1, group=(1, 3, 4)))) == \
        "in 1REDUCE_GRAD(1,3,4): a gradient sum that waits for workers 1, 3, 4"
    assert describe("") == ""


def test_the_fast_path_reads_the_lists_not_the_schedule():
    """The fast path's program is the lists' (`ChainProgram._dependencies`): it never derives the
    order of passes or messages from the schedule itself."""
    import ast
    from pathlib import Path

    import hetplan.sim.fast as fast

    tree = ast.parse(Path(fast.__file__).read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    assert "lower" in imported and not imported & {"schedule_order", "rank_orders", "SENDS_GRADIENTS"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_the_event_simulator_moves_the_messages_of_the_lists(cli, profiles, tmp_path, schedule):
    """resnet50 on hetero-4 in stages of 1 to 3 replicas of unlike speeds, 1 to 5 micro-batches:
    the event simulator's transfers (device to device, stage, micro-batch, direction), made from
    the lists' receives, are the lists' sends, one for one, and the cost table prices each."""
    from hetplan.cost import CostModel
    from hetplan.cost.table import step_costs
    from hetplan.io.clusters import load_cluster
    from hetplan.io.graphs import load_graph
    from hetplan.lowering import rank_groups
    from hetplan.plan import Plan, Stage
    from hetplan.sim import lowered_step
    from hetplan.sim.engine import _add_transfers, _Tasks, _Transfers

    path = tmp_path / "r50.json"
    assert cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", path).code == 0
    graph, cluster = load_graph(path), load_cluster("hetero-4")
    names = [n.id for n in graph.nodes]
    for devices in ((("a0", "t0"), ("v0", "t1")), (("t0",), ("a0", "v0", "t1")), (("a0", "v0", "t0"), ("t1",)),
                    (("a0",), ("t0",), ("v0",), ("t1",))):
        bounds = [len(names) * k // len(devices) for k in range(len(devices) + 1)]
        for m in (1, 2, 3, 5):
            plan = Plan(tuple(Stage(tuple(names[bounds[k]:bounds[k + 1]]), d) for k, d in enumerate(devices)), m,
                        schedule, "test")
            cm = CostModel(graph, cluster)
            model = step_costs(graph, cluster, plan, "relay", cm)
            tasks, xs = _Tasks(model), _Transfers(cluster)
            lowered = lowered_step(graph, cluster, plan, cm)
            _add_transfers(lowered, model, tasks, xs)
            simulated = sorted((xs.links[xs.link[x]], xs.stage[x], xs.mb[x], xs.fwd[x]) for x in range(len(xs.link)))
            groups = rank_groups(plan, lambda d: cluster.device(d).host)
            device = {groups[k][p][0]: d for k, st in enumerate(plan.stages) for p, d in enumerate(st.devices)}
            sent = sorted((f"{device[r]}->{device[op.peer]}", op.stage, op.microbatch, op.kind == "SEND_F")
                          for r, ops in enumerate(lowered.ops) for op in ops if op.kind in SENDS)
            assert simulated == sent, (devices, m)


def test_the_event_simulator_waits_for_what_the_lists_receive_and_nothing_else():
    """Take micro-batch 0's activations out of a 2-stage plan's lists (the send and its
    receive): the simulated stage 1 no longer waits for them, so its F0 starts at once and no
    transfer carries them. A simulator that made its messages by a rule of its own would still
    wait."""
    from hetplan.cost import CostModel
    from hetplan.cost.table import step_costs
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.plan import Plan, Stage
    from hetplan.sim import lowered_step
    from hetplan.sim.engine import run_events
    from strategies import V
    from strategies import chain as chain_graph

    two = cluster_from_spec({"devices": [{"id": "a", "type": V, "host": "x"}, {"id": "b", "type": V, "host": "y"}],
                             "network": {"inter_host": {"bandwidth": "1GB/s", "latency": "0us"}}}, "two")
    graph = chain_graph(4, edge_bytes=10**8, batch=4)
    plan = Plan((Stage(("n0", "n1"), ("a",)), Stage(("n2", "n3"), ("b",))), 2, "gpipe", "test")
    cm = CostModel(graph, two)
    model, lowered = step_costs(graph, two, plan, "relay", cm), lowered_step(graph, two, plan, cm)
    whole = run_events(model, two, lowered).timeline
    kept = [[op for op in ops if not (op.kind in (SEND_F, RECV_F) and op.microbatch == 0)] for ops in lowered.ops]
    cut = run_events(model, two, Lowered(tuple(map(tuple, kept)), lowered.micro, lowered.groups)).timeline

    def first_f0(timeline):
        return next(s.start_s for s in timeline.spans if s.resource == "b" and s.kind == "F" and s.microbatch == 0)

    def moved(timeline):
        return sorted((s.kind, s.microbatch) for s in timeline.spans if s.resource in ("a->b", "b->a"))

    assert first_f0(whole) > 0 and first_f0(cut) == 0
    assert ("F", 0) in moved(whole) and ("F", 0) not in moved(cut) and len(moved(cut)) == len(moved(whole)) - 1


def test_the_event_simulator_sums_what_the_lists_sum_in_their_order():
    """Three stages, the first and last sharing a tied weight, the last on two replicas: two sums
    after the passes, in this order: the tied weight over all three workers, which waits for the
    first stage (under GPipe the last to finish), then the last stage's own weights over its two.
    Take the tied sum out of the lists: the last stage sums and steps while the first still
    works. Swap the two sums in every list: the last stage's own sum runs early, the tied one
    after the first stage. Lists whose ranks disagree on the order are a cycle, refused. A
    simulator that summed by a rule of its own would take as long every time."""
    from hetplan.cost import CostModel
    from hetplan.cost.table import step_costs
    from hetplan.graph import Tied
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.plan import Plan, Stage
    from hetplan.sim import lowered_step
    from hetplan.sim.engine import run_events
    from strategies import V
    from strategies import chain as chain_graph

    four = cluster_from_spec({"devices": [{"id": d, "type": V, "host": "x"} for d in "abcd"]}, "four")
    graph = replace(chain_graph(3, params=10**8, batch=4), tied=(Tied(("n0", "n2"), 10**7),))
    plan = Plan((Stage(("n0",), ("a",)), Stage(("n1",), ("b",)), Stage(("n2",), ("c", "d"))), 2, "gpipe", "test")
    cm = CostModel(graph, four)
    model, lowered = step_costs(graph, four, plan, "relay", cm), lowered_step(graph, four, plan, cm)
    sums = [[op.group for op in ops if op.kind == REDUCE_GRAD] for ops in lowered.ops]
    assert sums == [[(0, 2, 3)], [], [(0, 2, 3), (2, 3)], [(0, 2, 3), (2, 3)]]
    tied, own = (s.seconds for s in model.syncs)

    def step(keep=lambda r, ops: ops):
        lists = tuple(tuple(keep(r, list(ops))) for r, ops in enumerate(lowered.ops))
        return run_events(model, four, Lowered(lists, lowered.micro, lowered.groups), record=False).step_s

    def swapped(r, ops):
        at = [i for i, op in enumerate(ops) if op.kind == REDUCE_GRAD]
        if len(at) == 2:
            ops[at[0]], ops[at[1]] = ops[at[1]], ops[at[0]]
        return ops

    first = max(s.end_s for s in run_events(model, four, lowered).timeline.spans if s.resource == "a"
                and s.microbatch >= 0)
    opt = model.stages[0].replicas[0].optimizer_s  # all four alike
    assert step() == pytest.approx(first + tied + own + opt)
    assert step(lambda r, ops: [op for op in ops if op.group != (0, 2, 3)]) == pytest.approx(first + opt)
    assert step(swapped) == pytest.approx(first + tied + opt)
    with pytest.raises(HetplanError, match="cycle"):
        step(lambda r, ops: swapped(r, ops) if r == 2 else ops)


def test_the_lists_fast_op_is_the_op():
    """The lowering makes its ops without the dataclass's constructor (`lowering._op`): each equals,
    hashes and prints as the one `Op` makes, and stays frozen."""
    import dataclasses

    from hetplan.lowering import _op

    made, built = _op(SEND_F, 1, 2, 3, (0, 4), 2), Op(SEND_F, 1, 2, 3, (0, 4), peer_stage=2)
    assert made == built and hash(made) == hash(built) and str(made) == str(built) == "1SEND_F2->3"
    assert dataclasses.asdict(made) == dataclasses.asdict(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.peer = 4
