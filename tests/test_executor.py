"""The pipeline executor, with its ranks as threads (`hetplan.runtime.local`): pipelined training
equals single-process training for every zoo model (the large ones at fewer layers) and the
transformers families users train, with replicas of different speeds, stages without parameters
and integer values crossing boundaries; each rank runs exactly the actions the simulator simulates."""


from dataclasses import replace
from unittest import mock

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.io.clusters import cluster_from_spec
from hetplan.lowering import ACTIVATIONS, GRADIENTS, RECEIVES, REDUCE_GRAD, SENDS, channel, dry_run, lower, rank_groups
from hetplan.lowering import lower as real_lower
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.rows import step_rows
from hetplan.runtime import sums as sums_module
from hetplan.runtime.launch import run_spec
from hetplan.runtime.local import run_threads
from hetplan.runtime.rank import group_table, spec_rows
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.stages import stage_modules
from hetplan.runtime.traces import SharedTraces, Traces, boundary_layouts, layout_rows
from hetplan.runtime.transport import LocalTransport
from hetplan.runtime.worker import _batches
from hetplan.schedule import ONE_STAGE_PER_RANK, rank_orders, schedule_order, stage_ranks
from hetplan.zoo import ZOO, load_model
from hetplan.zoo.faithful import switch_off_dropout
from hf_families import FAMILIES


def cpus(n, bindings=None):
    """n one-thread workers; `bindings` puts some of them elsewhere (a GPU: "cuda:0")."""
    bindings = bindings or ["cpu"] * n
    cpu = {"type": "cpu", "threads": 1, "binding": "cpu"}
    return cluster_from_spec({"name": "cpus", "devices": [
        {"id": f"c{i}", "host": "here", **(cpu if b == "cpu" else {"type": "h100-80gb", "binding": b})}
        for i, b in enumerate(bindings)]}, "cpus")


def no_dropout(zm):
    switch_off_dropout(zm.step)  # as the workers do with RunSettings.no_dropout
    return zm


def chain_plan(names, replicas, m, schedule, cuts=None):
    n = len(replicas)
    cuts = cuts or [len(names) * i // n for i in range(1, n)]
    bounds = [0, *cuts, len(names)]
    devices = iter(f"c{i}" for i in range(sum(replicas)))
    return Plan(tuple(Stage(tuple(names[bounds[k]:bounds[k + 1]]), tuple(next(devices) for _ in range(r)))
                      for k, r in enumerate(replicas)), m, schedule, "test")


def reference_step(zm, batch, m, lr, optimizer="sgd", precision="fp32"):
    """Single process: the micro-batches one after the other (batch norm sees micro-batches, as
    in the pipeline), each loss weighted by its share of the batch, one step of SGD, or of Adam
    on the dense gradients and SparseAdam on the sparse ones (torch's own, made here). In bf16
    or fp16, each forward under torch's autocast, as a training loop writes it."""
    params = list(zm.step.parameters())
    for p in params:
        p.grad = None
    size = next(iter(batch.values())).shape[0]
    chunks = {k: v.tensor_split(m) for k, v in batch.items()}
    total = 0.0
    device = next(iter(batch.values())).device.type
    for i in range(m):
        part = {k: c[i] for k, c in chunks.items()}
        with torch.autocast(device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision),
                            enabled=precision != "fp32"):
            loss = zm.step(**part) * (next(iter(part.values())).shape[0] / size)
        loss.backward()
        total += loss.item()
    if optimizer == "sgd":
        torch.optim.SGD(params, lr=lr).step()
        return total
    sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
    torch.optim.Adam([p for p in params if not any(p is q for q in sparse)], lr=lr).step()
    if sparse:
        torch.optim.SparseAdam(sparse, lr=lr).step()
    return total


# The traces of the models the tests here build, kept for the session: each is a zoo model built
# from seed 0 without dropout, so one model traces the same in every test at a number of rows
# (`SharedTraces` keys its traces by the rows' shapes), whatever batch a test builds it for; a
# model that holds other names, classes, shapes or dtypes is refused by `rebind`, never given another's.
SESSION_TRACES: dict[tuple, SharedTraces] = {}


def traced(zm, granularity="layer", shared=None, replicas=None, m=None, weights=None):
    """The step of a model without dropout (`no_dropout`) cut into traces (`shared`, else the
    session's for this model and its rows' shape) that the ranks of `run_threads` then take theirs
    from, and that cut: at the first number of rows at which the ranks read the boundaries'
    layouts (`rank.layout_rows`) where the plan's `replicas`, `m` and `weights` are given (equal
    weights unless given; another guess costs a trace, nothing else), else at 2 rows."""
    if shared is None:
        shapes = tuple((k, tuple(v.shape[1:])) for k, v in zm.batch.items())
        shared = SESSION_TRACES.setdefault((zm.name, shapes), SharedTraces())
    rows = next(iter(zm.batch.values())).shape[0]
    if replicas is not None:
        shares = weights or [[1.0] * r for r in replicas]
        rows = layout_rows(step_rows(rows, m, shares), rows)[0]
    else:
        rows = min(2, rows)
    return shared, shared.split(zm.step, {k: v[:rows] for k, v in zm.batch.items()}, granularity,
                                tuple(zm.block_classes or ()) or None)


def run_checked(spec, shared):
    """`run_threads`, checking that every rank sends and receives, in order and on its channel,
    the messages of its lowered list (`hetplan.lowering`), which pair up in the dry run: the
    messages pair by that order alone, so a rank whose order differed would get another's; and
    that it runs the gradient sums of its list (its REDUCE_GRAD ops), in that order."""
    log = {rank: [] for rank in range(spec.world)}
    summed, listed = {rank: [] for rank in range(spec.world)}, {}
    run_sums, run_sum = sums_module.run_sums, sums_module._run

    def logged_sums(prepared, transport, where=None):
        listed[prepared.role.rank] = [op.group for op in prepared.ops if op.kind == REDUCE_GRAD]
        return run_sums(prepared, transport, where)

    def logged_sum(prepared, transport, what, ranks):
        summed[prepared.role.rank].append(ranks)
        return run_sum(prepared, transport, what, ranks)

    isend, recv = LocalTransport.isend, LocalTransport.recv
    pipeline = (ACTIVATIONS, GRADIENTS)  # not the rings of sharded stages' sums (`runtime.sharding`)

    def logged_isend(self, tensor, dst, tag):
        if tag in pipeline:
            log[self.rank].append(("S", dst, tag))
        return isend(self, tensor, dst, tag)

    def logged_recv(self, tensor, src, tag):
        if tag in pipeline:
            log[self.rank].append(("R", src, tag))
        return recv(self, tensor, src, tag)

    with mock.patch.object(LocalTransport, "isend", logged_isend), \
            mock.patch.object(LocalTransport, "recv", logged_recv), \
            mock.patch.object(sums_module, "run_sums", logged_sums), mock.patch.object(sums_module, "_run", logged_sum):
        results = run_threads(spec, shared=shared)
    assert summed == {rank: listed[rank] for rank in range(spec.world)}
    for rank, res in enumerate(results):
        res["sums"] = summed[rank]
    groups = rank_groups(spec.plan, {r.device: r.host for r in spec.ranks}.__getitem__)
    assert groups == group_table(spec)
    lowered = lower(spec.plan.schedule, groups, spec.plan.stage_ranks, spec_rows(spec, spec.plan))
    assert dry_run(lowered) == []
    for rank, ops in enumerate(lowered.ops):
        said = [("S" if op.kind in SENDS else "R", op.peer, channel(op)) for op in ops if op.kind in SENDS + RECEIVES]
        assert log[rank] == said, f"rank {rank}: {log[rank][:6]} ... against its list {lowered.lines()[rank][:200]}"
        assert results[rank]["actions"] == [str(op) for op in ops if op.kind in "FBIW"]
    return results


def pipelined_vs_single(ref, replicas, m, schedule, batch=4, seq=16, weights=None, cuts=None, names_of=None,
                        bindings=None, ref_device="cpu", optimizer="sgd", granularity="layer", precision="fp32",
                        shard=(), level=1, recompute="none", ref_m=None):
    """Run one step pipelined (threads) and single-process (on `ref_device`, in `ref_m` micro-batches,
    by default the plan's `m`; 1: the whole batch at once); returns the largest weight difference,
    the largest weight change, the two losses, the plan and the run's results."""
    lr = 0.1
    zm = no_dropout(load_model(ref, batch_size=batch, seq_len=seq, seed=0))
    shared, split = traced(zm, granularity, replicas=replicas, m=m, weights=weights)
    names = [p.name for p in split.pieces]
    plan = chain_plan(names, replicas, m, schedule, cuts=names_of(names) if names_of else cuts)
    plan = replace(plan, precision=precision,
                   stages=tuple(replace(s, shard=level if k in shard else 0, recompute=recompute)
                                for k, s in enumerate(plan.stages)))
    spec = run_spec(plan, cpus(sum(replicas), bindings), ref, RunSettings(batch_size=batch, seq_len=seq,
                    granularity=granularity, block_classes=tuple(zm.block_classes or ()), steps=1, warmup=0,
                    optimizer=optimizer, lr=lr, out_dir="unused", no_dropout=True), weights=weights)
    results = run_checked(spec, shared)
    before = {id(p): p.detach().clone() for p in zm.step.parameters()}
    zm.step.to(ref_device)  # in place: the stage modules below share these parameters
    ref_loss = reference_step(zm, {k: v.to(ref_device) for k, v in _batches(spec, zm, 0).items()}, ref_m or m, lr,
                              optimizer, precision)
    modules = stage_modules(split, plan)
    worst = moved = 0.0
    for rank, res in enumerate(results):
        for name, p in modules[spec.ranks[rank].stage].named_parameters():
            worst = max(worst, (res["weights"][name] - p.detach().cpu()).abs().max().item())
            moved = max(moved, (p.detach().cpu() - before[id(p)]).abs().max().item())
    last = len(replicas) - 1
    loss = sum(res["losses"][0] for rank, res in enumerate(results) if spec.ranks[rank].stage == last)
    return worst, moved, loss, ref_loss, plan, spec, results


def check(worst, moved, loss, ref_loss, *_, tol=1e-5):
    assert moved > 1e-4  # the step changed the weights...
    assert worst <= tol  # ...as single-process training does
    assert loss == pytest.approx(ref_loss, rel=tol)


# The large zoo models by the same builders and classes at fewer layers, ctr-dnn with small tables
# (`user_models`): each further layer or row repeats what these cut, carry and sum, and the full
# sizes cost minutes of the suite. gpt2 is gpt2-tiny's builder and classes at 124M parameters.
SHORT = {"bert-base": "user_models:bert_base_short", "vit-base": "user_models:vit_base_short",
         "resnet50": "user_models:resnet50_short", "ctr-dnn": "user_models:ctr_small"}


@pytest.mark.parametrize("name", [name for name in ZOO if name != "gpt2"])
def test_two_stages_of_every_zoo_model_equal_single_process(name):
    schedule = ONE_STAGE_PER_RANK[list(ZOO).index(name) % len(ONE_STAGE_PER_RANK)]  # each schedule in turn
    check(*pipelined_vs_single(SHORT.get(name, name), [1, 1], 2, schedule))


@pytest.mark.parametrize("replicas", [[1, 1], [2, 1]])
def test_ctr_tables_and_mlp_on_different_workers_equal_single_process_with_adam(replicas):
    """HeterPS's CTR workload: ctr-dnn's parser and 26 tables (sparse gradients) on one stage, replicated or
    not (replicas sum their sparse gradients), its MLP on another; one step of Adam, SparseAdam
    on the tables, equals torch's own Adam and SparseAdam in one process."""
    def at_the_mlp(names):
        return [next(i for i, n in enumerate(names) if n.startswith("mlp"))]

    worst, moved, loss, ref_loss, plan, *_ = pipelined_vs_single(
        "user_models:ctr_small", replicas, 2, "1f1b", batch=16, names_of=at_the_mlp, optimizer="adam")
    assert [n for n in plan.stages[0].nodes if n.startswith("shards")] and plan.stages[1].nodes[0] == "mlp.0"
    assert not any(n.startswith(("shards", "parser")) for n in plan.stages[1].nodes)
    check(worst, moved, loss, ref_loss)


# the families whose code differs from the zoo's in what the pipeline must carry or cut (the others
# of `FAMILIES`, decoder LMs like these, are in bench/model_families.py's table)
DISTINCT = tuple(f for f in FAMILIES if f not in ("opt", "gpt_neox", "roberta", "phi", "mixtral_router"))


# Mamba's scan runs once per position, in Python here (the slow path, without its CUDA kernels), and
# torch.export records every step of it: 8 positions cross the same boundaries as 16, traced in half the time
SEQ = {"mamba": 8}


@pytest.mark.parametrize("family", DISTINCT)
def test_transformers_families_run_in_four_stages(family):
    """Model families (grouped-query attention and rotary tables, an encoder-decoder,
    masks that cross boundaries as views, a CNN, per-stage attention heads, a CTC loss), as
    4-stage pipelines: a first stage, two that receive and send, a last one (the zoo's models run
    in 2 stages, under every schedule); every other family under zero bubble, whose split
    backward walks each family's autograd graph."""
    schedule = ("1f1b", "zero-bubble")[DISTINCT.index(family) % 2]
    check(*pipelined_vs_single(f"hf_families:{family}", [1] * 4, 2, schedule, seq=SEQ.get(family, 16)))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "mamba"])
def test_lists_of_tensors_cut_apart_at_block_granularity_too(family):
    """Mixture-of-experts routing and Mamba's scan split tensors into lists; cut between blocks
    (4 stages of whole blocks), only tensors cross, and the step equals one process."""
    check(*pipelined_vs_single(f"hf_families:{family}", [1] * 4, 2, "gpipe", granularity="block",
                               seq=SEQ.get(family, 16)))


# each shape under one schedule (both schedules appear; tests/test_runtime.py runs 3 + 1 under
# GPipe in worker processes)
@pytest.mark.parametrize("replicas,weights,schedule", [
    ([3, 1], [[1.0, 2.0, 4.0], [1.0]], "1f1b"),  # 3 + 1, of three speeds
    ([1, 2, 1], [[1.0], [1.0, 3.0], [1.0]], "1f1b"),
    ([2, 1, 2], [[2.0, 1.0], [1.0], [1.0, 1.0]], "gpipe"),  # llama: rotary tables and masks have no batch dimension
])
def test_uneven_replicas_split_by_speed_equal_single_process(schedule, replicas, weights):
    name = "llama-tiny" if replicas == [2, 1, 2] else "gpt2-tiny"
    result = pipelined_vs_single(name, replicas, 3, schedule, batch=10, weights=weights)
    check(*result)
    _, _, _, _, plan, spec, results = result
    rows = step_rows(10, 3, weights)
    orders = schedule_order(schedule, len(replicas), 3)
    for rank, res in enumerate(results):  # exactly the simulator's actions, skipping slices with no row
        k, p = spec.ranks[rank].stage, spec.ranks[rank].replica
        assert res["actions"] == [str(a) for a in orders[k] if rows.rows(k, a.microbatch, p) > 0]


@pytest.mark.parametrize("replicas,weights", [([1], [[1.0]]), ([3], [[1.0, 2.0, 3.0]])])
def test_one_stage_alone_or_data_parallel_over_replicas_of_three_speeds(replicas, weights):
    check(*pipelined_vs_single("gpt2-tiny", replicas, 2, "1f1b", batch=8, weights=weights))


def test_replicas_of_two_types_take_the_weights_given_or_need_a_graph():
    """A GPU and a CPU replica of one stage: with no graph there are no speeds, unless the caller
    gives them (tests/test_gpu.py runs such a plan on a GPU)."""
    plan = chain_plan(["a", "b"], [1, 2], 2, "gpipe")
    cluster = cpus(3, ["cpu", "cuda:0", "cpu"])
    settings = RunSettings(batch_size=10, seq_len=16, granularity="layer", out_dir="unused")
    with pytest.raises(HetplanError, match="replicas of different types"):
        run_spec(plan, cluster, "gpt2-tiny", settings)
    spec = run_spec(plan, cluster, "gpt2-tiny", settings, weights=[[1], [4, 1]])
    assert spec.replica_weights == ((1.0,), (4.0, 1.0))
    for wrong in ([[1], [4]], [[1], [4, 0]]):
        with pytest.raises(HetplanError, match="one weight > 0 per replica"):
            run_spec(plan, cluster, "gpt2-tiny", settings, weights=wrong)


def test_a_replica_with_no_row_of_a_microbatch_skips_it():
    """A micro-batch of 2 rows over 3 replicas: one of them gets none and does nothing for it."""
    result = pipelined_vs_single("gpt2-tiny", [1, 3], 2, "1f1b", weights=[[1.0], [1.0, 1.0, 1.0]])
    check(*result)
    results = result[-1]
    assert sorted(len(r["actions"]) for r in results[1:]) == [2, 2, 4]  # micro-batches of 2: one replica idles


def test_a_stage_without_parameters_and_integers_across_two_boundaries():
    """gpt2-tiny in three stages, the middle one only a dropout (no parameters), so the token
    ids and labels (int64) cross two boundaries; more micro-batches than stages under 1F1B, and
    fewer (GPipe: in worker processes, tests/test_runtime.py)."""
    zm = load_model("gpt2-tiny", batch_size=6, seq_len=16)
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    middle = names.index("transformer.drop")

    def cuts(_):
        return [middle, middle + 1]

    for m, schedule in ((4, "1f1b"), (2, "1f1b")):
        result = pipelined_vs_single("gpt2-tiny", [1, 1, 1], m, schedule, batch=6, names_of=cuts)
        check(*result)
        plan = result[4]
        assert plan.stages[1].nodes == ("transformer.drop",)
    bounds = boundary_layouts(Traces(zm.step, zm.batch, plan, "layer", None, {}))
    for lays in bounds:  # the labels (flattened to B*S) and positions (1 x S) cross both boundaries
        ints = [(lay.batch_dim, lay.per_row, lay.grad) for lay in lays if lay.dtype == torch.int64]
        assert ints == [(0, 16, False), (None, 0, False)]


def reversed_messages(*args, **kwargs):
    """`lower`'s lists with each pass's receives, and its sends, in the reverse order: as valid
    (each pair of ranks still sends and receives in one order), but not the order the runtime
    would reach by a rule of its own."""
    lowered = real_lower(*args, **kwargs)
    lists = []
    for ops in lowered.ops:
        out, run = [], []
        for op in ops:
            if run and (op.kind in SENDS) != (run[0].kind in SENDS) or op.kind not in SENDS + RECEIVES:
                out += reversed(run)
                run = []
            (run if op.kind in SENDS + RECEIVES else out).append(op)
        lists.append(tuple(out + run[::-1]))
    return replace(lowered, ops=tuple(lists))


def test_the_runtime_sends_and_receives_in_the_order_of_its_list(monkeypatch):
    """gpt2-tiny in a stage and two replicas: stage 0 sends each micro-batch's activations to the
    two replicas, and takes their gradients, in the order its list says, here the reverse of the
    lowering's; every rank's messages follow its changed list (`run_checked`), and the step still
    equals one process (the parts of a micro-batch join by their rows, whatever their order)."""
    import hetplan.runtime.rank as rank_module

    monkeypatch.setattr(rank_module, "lower", reversed_messages)
    monkeypatch.setitem(globals(), "lower", reversed_messages)
    result = pipelined_vs_single("gpt2-tiny", [1, 2], 2, "gpipe", batch=8)
    check(*result)
    spec = result[5]
    rows = spec_rows(spec, spec.plan)
    groups = group_table(spec)
    first = [str(op) for op in reversed_messages(spec.plan.schedule, groups, spec.plan.stage_ranks, rows).ops[0]]
    assert first[:3] == ["0F0", "0SEND_F0->2", "0SEND_F0->1"]  # the real lowering sends to rank 1 first
    assert [str(op) for op in real_lower(spec.plan.schedule, groups, spec.plan.stage_ranks, rows).ops[0]][1] \
        == "0SEND_F0->1"


def reversed_sums(schedule, groups, stage_ranks, rows, sums=(), links=None):
    """`lower`'s lists with the gradient sums in the reverse of the global order: as valid (every
    rank reverses them alike), but not the order a runtime that ran its own would take."""
    return real_lower(schedule, groups, stage_ranks, rows, list(sums)[::-1], links)


def test_the_runtime_sums_gradients_in_the_order_of_its_list(monkeypatch):
    """gpt2-tiny, its first stage on one worker and its last on two: the tied embedding is summed
    over all three, the last stage's own weights over its two; with the lists' sums reversed,
    each rank runs them in the reversed order (`run_checked`) and the step still equals one
    process."""
    import hetplan.runtime.rank as rank_module

    monkeypatch.setattr(rank_module, "lower", reversed_sums)
    result = pipelined_vs_single("gpt2-tiny", [1, 2], 2, "gpipe", batch=8)
    check(*result)
    assert [res["sums"] for res in result[6]] == [[(0, 1, 2)], [(1, 2), (0, 1, 2)], [(1, 2), (0, 1, 2)]]


def test_every_rank_reads_the_layouts_at_the_steps_smallest_slice_and_one_more():
    assert layout_rows(step_rows(8, 2, [[1.0], [1.0]]), 8) == (4, 5)  # its one slice size, and one more
    assert layout_rows(step_rows(8, 1, [[1.0]]), 8) == (8, 7)  # the whole batch: one fewer
    assert layout_rows(step_rows(8, 2, [[1.0], [3.0, 1.0]]), 8) == (3, 4)  # slices of 4, 3 and 1 rows
    assert layout_rows(step_rows(4, 4, [[1.0]]), 4) == (2, 3)  # slices of 1 row only
    assert layout_rows(None, 2) == (1, 2)


def test_two_stages_on_one_device_run_as_two_workers():
    """A plan with `shared_devices`: stages 0 and 2 on the same device (one worker each)."""
    zm = no_dropout(load_model("gpt2-tiny", batch_size=4, seq_len=16, seed=0))
    shared, split = traced(zm)
    names = [p.name for p in split.pieces]
    a, b = len(names) // 3, 2 * len(names) // 3
    plan = Plan((Stage(tuple(names[:a]), ("c0",)), Stage(tuple(names[a:b]), ("c1",)), Stage(tuple(names[b:]), ("c0",))),
                2, "1f1b", "test", shared_devices=True)
    spec = run_spec(plan, cpus(2), "gpt2-tiny", RunSettings(batch_size=4, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=0.1, out_dir="unused", no_dropout=True))
    assert [(r.stage, r.device) for r in spec.ranks] == [(0, "c0"), (1, "c1"), (2, "c0")]
    results = run_checked(spec, shared)
    ref_loss = reference_step(zm, _batches(spec, zm, 0), 2, 0.1)
    assert results[2]["losses"][0] == pytest.approx(ref_loss, rel=1e-5)
    for rank, module in enumerate(stage_modules(split, plan)):
        for name, p in module.named_parameters():
            assert (results[rank]["weights"][name] - p.detach()).abs().max().item() <= 1e-5


def test_inception_branches_cross_boundaries():
    """Four parallel branches cut across stages: several values per boundary, batch norm inside."""
    result = pipelined_vs_single("inception-tiny", [1, 1, 1], 2, "1f1b", batch=4)
    check(*result)


@pytest.mark.parametrize("name,replicas,m,weights", [
    ("gpt2-tiny", [1, 1, 1, 1], 6, None),  # ids and labels cross every boundary; tied embedding
    ("gpt2-tiny", [1, 2, 1], 3, [[1.0], [1.0, 2.0], [1.0]]),  # uneven replicas, fewer micro-batches than stages
    ("inception-tiny", [1, 1], 4, None),  # batch norm, branches
])
def test_zero_bubble_splits_the_backward_and_equals_single_process(name, replicas, m, weights):
    """The backward split into I and W, W deferred as the schedule says: the weights after one
    step equal one process's, and every rank ran the schedule's actions."""
    result = pipelined_vs_single(name, replicas, m, "zero-bubble", batch=6 if m == 6 else 8, weights=weights)
    check(*result)
    _, _, _, _, plan, spec, results = result
    rows = step_rows(spec.settings.batch_size, m, spec.replica_weights)
    orders = schedule_order("zero-bubble", len(replicas), m)
    for rank, res in enumerate(results):
        k, p = spec.ranks[rank].stage, spec.ranks[rank].replica
        assert res["actions"] == [str(a) for a in orders[k] if rows.rows(k, a.microbatch, p) > 0]
        assert any(a.endswith(f"W{m - 1}") for a in res["actions"][-1:])


def test_zero_bubble_on_ctr_tables_with_sparse_gradients_and_adam():
    def at_the_mlp(names):
        return [next(i for i, n in enumerate(names) if n.startswith("mlp"))]

    check(*pipelined_vs_single("user_models:ctr_small", [2, 1], 2, "zero-bubble", batch=16, names_of=at_the_mlp,
                               optimizer="adam"))


def interleaved_plan(names, groups, per_rank, m, schedule="interleaved-1f1b", shard=0):
    """`groups[g]` replicas for rank g; the pieces cut evenly into len(groups) x per_rank stages,
    stage s on the devices of the group the schedule's map gives it."""
    n = len(groups)
    first = chain_plan(names, groups, m, "1f1b")
    stages = n * per_rank
    bounds = [len(names) * i // stages for i in range(stages + 1)]
    holder = stage_ranks(schedule, stages, n)
    return Plan(tuple(Stage(tuple(names[bounds[s]:bounds[s + 1]]), first.stages[holder[s]].devices,
                            shard=shard if groups[holder[s]] > 1 else 0)
                      for s in range(stages)), m, schedule, "test")


@pytest.mark.parametrize("name,groups,per_rank,m,weights,schedule,shard", [
    ("gpt2-tiny", [1, 1], 2, 4, None, "interleaved-1f1b", 0),  # tied embedding: stages 0 and 3 on different workers
    ("gpt2-tiny", [1, 1, 1], 2, 3, None, "interleaved-1f1b", 0),  # fewer micro-batches than ranks
    ("gpt2-tiny", [1, 2], 2, 2, [[1.0], [1.0, 2.0], [1.0], [1.0, 2.0]], "interleaved-1f1b", 0),  # replicated, uneven
    ("inception-tiny", [1, 1], 2, 4, None, "interleaved-1f1b", 0),  # branches, batch norm
    # ZB-V: the first and the last stage on worker 0 (the tied embedding's two ends on one
    # worker), the backward split in I and W
    ("gpt2-tiny", [1, 1], 2, 4, None, "zb-v", 0),
    ("gpt2-tiny", [1, 1, 1], 2, 2, None, "zb-v", 0),  # fewer micro-batches than a full V needs
    ("gpt2-tiny", [1, 2], 2, 3, [[1.0], [1.0, 2.0], [1.0, 2.0], [1.0]], "zb-v", 0),  # replicated, uneven
    # two sharded stages on each replicated worker, their weights gathered node by node
    ("gpt2-tiny", [1, 2], 2, 2, [[1.0], [1.0, 2.0], [1.0], [1.0, 2.0]], "interleaved-1f1b", 3),
])
def test_interleaved_schedules_hold_several_stages_per_worker_and_equal_single_process(name, groups, per_rank, m,
                                                                                      weights, schedule, shard):
    """Each worker runs its stages in its rank's order (torch's ScheduleInterleaved1F1B, or
    ScheduleZBVZeroBubble on its V-shaped map); the weights after one step equal one process's."""
    batch, lr = 8, 0.1
    zm = no_dropout(load_model(name, batch_size=batch, seq_len=16, seed=0))
    shared, split = traced(zm)
    plan = interleaved_plan([p.name for p in split.pieces], groups, per_rank, m, schedule, shard)
    spec = run_spec(plan, cpus(sum(groups)), name, RunSettings(batch_size=batch, seq_len=16, granularity="layer",
                    block_classes=tuple(zm.block_classes or ()), steps=1, warmup=0, optimizer="sgd", lr=lr,
                    out_dir="unused", no_dropout=True), weights=weights)
    assert spec.world == sum(groups)
    results = run_checked(spec, shared)
    before = {id(p): p.detach().clone() for p in zm.step.parameters()}
    ref_loss = reference_step(zm, _batches(spec, zm, 0), m, lr)
    worst = moved = 0.0
    modules = stage_modules(split, plan)
    for rank, res in enumerate(results):
        me = spec.ranks[rank]
        held = [modules[k] for k in plan.rank_stages[plan.stage_ranks[me.stage]]]
        assert set(res["weights"]) == {n for mod in held for n, _ in mod.named_parameters()}
        for mod in held:
            for pname, p in mod.named_parameters():
                worst = max(worst, (res["weights"][pname] - p.detach()).abs().max().item())
                moved = max(moved, (p.detach() - before[id(p)]).abs().max().item())
    last = plan.stage_ranks[-1]  # the rank holding the last stage computes the loss
    loss = sum(res["losses"][0] for rank, res in enumerate(results) if plan.stage_ranks[spec.ranks[rank].stage] == last)
    check(worst, moved, loss, ref_loss)
    rows = step_rows(spec.settings.batch_size, m, spec.replica_weights)
    orders = rank_orders(schedule, len(plan.stages), m, len(groups))
    for rank, res in enumerate(results):
        me = spec.ranks[rank]
        assert res["actions"] == [str(a) for a in orders[plan.stage_ranks[me.stage]]
                                  if rows.rows(a.stage, a.microbatch, me.replica)]


def v_gpipe(ranks, stages, m):
    """A schedule of a test's own, on ZB-V's V-shaped map (stage s on rank s, then on rank
    2n - 1 - s): each rank runs all forward passes of its stages in stage order, then all
    backward passes in reverse."""
    from hetplan.schedule import Action

    held = [[s for s in range(stages) if v_rank(s, ranks) == r] for r in range(ranks)]
    return tuple(tuple(Action(s, "F", j) for s in mine for j in range(m))
                 + tuple(Action(s, "B", j) for s in reversed(mine) for j in range(m)) for mine in held)


def v_rank(stage, ranks):
    return stage % (2 * ranks) if stage % (2 * ranks) < ranks else 2 * ranks - 1 - stage % (2 * ranks)


def test_a_schedule_with_its_own_stage_to_rank_map_needs_nothing_but_its_entry(monkeypatch):
    """A schedule is its entry in `hetplan.schedule.SCHEDULES`: with a V-shaped map (stages 0
    and 3 on one worker, 1 and 2 on the other) the plan validates against the map, the simulator
    runs each device's list and the runtime's weights equal one process's."""
    from hetplan import schedule as schedule_module
    from hetplan.schedule import Schedule
    from hetplan.sim import simulate

    v = Schedule("v-gpipe", None, lambda stages, index, m: m, False, "ScheduleGPipe", "a test's", rank_order=v_gpipe,
                 stage_rank=v_rank)
    monkeypatch.setitem(schedule_module.SCHEDULES, "v-gpipe", v)
    batch, lr, m = 8, 0.1, 2
    zm = no_dropout(load_model("gpt2-tiny", batch_size=batch, seq_len=16, seed=0))
    shared, split = traced(zm)
    names = [p.name for p in split.pieces]
    bounds = [len(names) * i // 4 for i in range(5)]
    plan = Plan(tuple(Stage(tuple(names[bounds[s]:bounds[s + 1]]), (f"c{v_rank(s, 2)}",)) for s in range(4)), m,
                "v-gpipe", "test")
    assert plan.stage_ranks == (0, 1, 1, 0) and plan.rank_stages == ((0, 3), (1, 2))
    spec = run_spec(plan, cpus(2), "gpt2-tiny", RunSettings(batch_size=batch, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=lr, out_dir="unused", no_dropout=True))
    assert [(r.stage, r.device) for r in spec.ranks] == [(0, "c0"), (1, "c1")]
    results = run_checked(spec, shared)
    assert results[0]["actions"] == [str(a) for a in v_gpipe(2, 4, m)[0]]
    ref_loss = reference_step(zm, _batches(spec, zm, 0), m, lr)
    modules = stage_modules(split, plan)
    for rank, held in enumerate(plan.rank_stages):
        for k in held:
            for pname, p in modules[k].named_parameters():
                assert (results[rank]["weights"][pname] - p.detach()).abs().max().item() <= 1e-5
    assert results[0]["losses"][0] == pytest.approx(ref_loss, rel=1e-5)  # worker 0 holds the last stage
    graph = chain_graph_for(plan)
    spans = simulate(graph, cpus(2), plan).timeline.spans
    ran = [s.label for s in sorted(spans, key=lambda s: s.start_s) if s.resource == "c0" and s.kind in "FB"]
    assert ran == [str(a) for a in v_gpipe(2, 4, m)[0]]


def chain_graph_for(plan):
    """A graph of the plan's nodes in a chain, each taking 1 ms each way on a 1-thread CPU."""
    from hetplan.graph import Edge, Graph, Node

    names = [n for s in plan.stages for n in s.nodes]
    nodes = tuple(Node(n, "Linear", {"cpu-1t": 1e-3}, {"cpu-1t": 1e-3}) for n in names)
    return Graph("chain", nodes, tuple(Edge(a, b, 1000) for a, b in zip(names, names[1:], strict=False)), 8, "cpu-1t")
