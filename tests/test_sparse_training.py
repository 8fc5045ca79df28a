"""Sparse gradients in the runtime: embedding tables built with sparse=True train with
SparseAdam beside Adam, and replicas sum their sparse gradients into the union of their rows."""

import threading

import pytest
import torch
from torch import nn

from hetplan.pieces.optim import StageOptimizer
from hetplan.runtime.gradients import reduce_gradients, sparse_parameter_ids
from hetplan.runtime.transport import LocalHub


def _model(sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"bag": nn.EmbeddingBag(50, 4, mode="sum", sparse=sparse), "head": nn.Linear(4, 1)})


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model["head"](model["bag"](ids)).square().mean()


def test_adam_on_sparse_tables_is_sparse_adam_beside_adam():
    """Adam refuses sparse gradients; the stage's optimizer gives the table SparseAdam (lazy Adam:
    only the rows looked up move) and the dense layer Adam, exactly as the two torch optimizers."""
    ids = torch.tensor([[1, 2], [2, 7]])
    model, reference = _model(sparse=True), _model(sparse=True)
    with pytest.raises(RuntimeError, match="sparse"):
        _loss(reference, ids).backward()
        torch.optim.Adam(reference.parameters(), lr=0.1).step()
    reference = _model(sparse=True)
    ref_opts = [torch.optim.SparseAdam([reference["bag"].weight], lr=0.1),
                torch.optim.Adam(reference["head"].parameters(), lr=0.1)]
    opt = StageOptimizer(model.parameters(), "adam", 0.1)
    for _ in range(3):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            _loss(m, ids).backward()
        opt.step()
        for o in ref_opts:
            o.step()
    assert opt.sparse == [True, False, False]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b)
    untouched = [r for r in range(50) if r not in (1, 2, 7)]
    assert torch.equal(model["bag"].weight[untouched], _model(sparse=True)["bag"].weight[untouched])


def test_the_optimizer_state_survives_a_checkpoint():
    ids = torch.tensor([[3, 4]])
    model = _model(sparse=True)
    opt = StageOptimizer(model.parameters(), "adam", 0.1)
    _loss(model, ids).backward()
    opt.step()
    saved = opt.state_dict()
    again = StageOptimizer(model.parameters(), "adam", 0.1)
    again.load_state_dict(saved)  # before any step: the split comes from the checkpoint
    assert again.sparse == [True, False, False]
    assert torch.equal(again.optimizers[1].state_dict()["state"][0]["exp_avg"],
                       opt.optimizers[1].state_dict()["state"][0]["exp_avg"])
    fresh = StageOptimizer(model.parameters(), "adam", 0.1)
    fresh.load_state_dict(StageOptimizer(model.parameters(), "adam", 0.1).state_dict())
    assert fresh.sparse is None


def test_sgd_takes_sparse_and_dense_gradients():
    model, dense = _model(sparse=True), _model(sparse=False)
    ids = torch.tensor([[1, 9]])
    for m in (model, dense):
        _loss(m, ids).backward()
    StageOptimizer(model.parameters(), "sgd", 0.5).step()
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    for a, b in zip(model.parameters(), dense.parameters(), strict=True):
        assert torch.allclose(a, b)


class _Counting:
    """A rank's transport that records the number of elements of every all-reduce it joins."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.sizes = inner, inner.rank, []

    def all_reduce(self, tensor, ranks):
        self.sizes.append(tensor.numel())
        self.inner.all_reduce(tensor, ranks)

    def wire(self, ranks):
        return self.inner.wire(ranks)


def _reduce_params(shapes: list, grads: list[list], tables: set[int]) -> tuple[list, list]:
    """Each of len(grads) ranks (threads joined by a `LocalHub`) holds parameters of `shapes`
    (a shape, or a shape and a dtype) with gradients grads[rank] (cloned: a dense sum is written
    into its gradient); the parameters at positions `tables` are tables with sparse gradients.
    Returns each rank's summed gradients and the sizes of the all-reduces it joined."""
    n = len(grads)
    hub, out, sizes = LocalHub(n), [None] * n, [None] * n
    specs = [s if isinstance(s[1], torch.dtype) else (s, torch.float32) for s in shapes]

    def rank(r: int) -> None:
        params = [nn.Parameter(torch.zeros(*shape, dtype=dtype)) for shape, dtype in specs]
        for prm, g in zip(params, grads[r], strict=True):
            prm.grad = None if g is None else g.clone()
        transport = _Counting(hub.transport(r))
        reduce_gradients([(tuple(range(n)), params)], transport, {id(params[k]) for k in tables})
        out[r], sizes[r] = [prm.grad for prm in params], transport.sizes

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, sizes


def _reduce_on_ranks(grads: list[torch.Tensor | None], table: bool = True, shape=(6, 2)) -> tuple[list, list]:
    """Each rank holds one parameter of `shape` (a table with sparse gradients, or a dense one)
    with the given gradient; returns the summed gradients and each rank's all-reduce sizes."""
    out, sizes = _reduce_params([shape], [[g] for g in grads], {0} if table else set())
    return [o[0] for o in out], sizes


def _rows(rows: list[int], value: float) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([rows]), torch.full((len(rows), 2), value), (6, 2),
                                   check_invariants=True)


def test_replicas_sum_sparse_gradients_into_the_union_of_their_rows():
    """Replicas of a stage that hold a table looked up different rows: the sum is sparse (for
    SparseAdam) over the union of the rows, as the whole batch's gradient in one process; a
    replica without a gradient agrees; a dense parameter is summed densely."""
    (a, b), _ = _reduce_on_ranks([_rows([0, 2], 1.0), _rows([2, 5], 2.0)])
    for g in (a, b):
        assert g.is_sparse
        assert g.coalesce().indices().flatten().tolist() == [0, 2, 5]
        assert torch.equal(g.to_dense(), _rows([0, 2], 1.0).to_dense() + _rows([2, 5], 2.0).to_dense())
    (a, b), _ = _reduce_on_ranks([_rows([4], 3.0), None])
    assert a.is_sparse and b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
    assert a.coalesce().indices().flatten().tolist() == [4]
    (a, b), _ = _reduce_on_ranks([None, None])
    assert a is None and b is None  # no row anywhere: nothing for the optimizer to update
    dense, _ = _reduce_on_ranks([torch.ones(6, 2), torch.ones(6, 2)], table=False)
    assert not dense[0].is_sparse and torch.equal(dense[0], torch.full((6, 2), 2.0))


def test_a_row_that_sums_to_zero_stays_in_the_gradient():
    """One process on the whole batch gets every looked-up row in its gradient, even one whose
    gradients cancel; SparseAdam then moves its moments. The replicas' sum keeps it too."""
    (a, _), _ = _reduce_on_ranks([_rows([1, 3], 1.0), _rows([3], -1.0)])
    assert a.coalesce().indices().flatten().tolist() == [1, 3]
    assert a.coalesce().values()[1].abs().sum() == 0


def test_replicas_exchange_the_rows_not_the_table():
    """A 100,000-row table of which three replicas looked up 2, 3 and 1 rows: what they all-reduce
    is the counts (one per replica), the indices (6) and the union's values (4 rows of 4), never
    the table's 400,000 numbers."""
    shape = (100_000, 4)

    def rows(idx, value):
        return torch.sparse_coo_tensor(torch.tensor([idx]), torch.full((len(idx), 4), value), shape)

    grads = [rows([7, 99_999], 1.0), rows([7, 50, 51], 2.0), rows([51], 3.0)]
    out, sizes = _reduce_on_ranks(grads, shape=shape)
    assert sizes == [[3, 6, 16]] * 3
    expected = sum(g.to_dense() for g in grads)
    for g in out:
        assert g.coalesce().indices().flatten().tolist() == [7, 50, 51, 99_999]
        assert torch.equal(g.to_dense(), expected)


def test_two_tables_and_dense_parameters_on_three_ranks():
    """Each rank holds two tables (one of them with a gradient uncoalesced, a repeated row) and
    two dense parameters, one of them with a sparse gradient although it is not a table: every
    rank ends with the sums, the tables sparse over the union of their rows."""
    def sp(rows, value, n=8):
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.full((len(rows), 3), value), (n, 3))

    grads = [[sp([1, 1, 4], 1.0), sp([0], 2.0, 5), torch.ones(2, 2), None],
             [None, sp([4, 2], 3.0, 5), torch.ones(2, 2), sp([3], 1.0, 4).coalesce()],
             [sp([7], 5.0), None, None, None]]
    shapes = [(8, 3), (5, 3), (2, 2), (4, 3)]
    out, _ = _reduce_params(shapes, grads, {0, 1})
    for k in range(len(shapes)):
        expected = sum(g[k].to_dense() for g in grads if g[k] is not None)
        for r in range(3):
            assert out[r][k].is_sparse == (k < 2)
            assert torch.equal(out[r][k].to_dense(), expected)
    assert out[0][0].coalesce().indices().flatten().tolist() == [1, 4, 7]
    assert out[2][1].coalesce().indices().flatten().tolist() == [0, 2, 4]


def test_the_optimizer_knows_a_table_before_its_first_gradient():
    """A table no replica looked up at the first step has no gradient; told which parameters are
    tables, the stage's optimizer still gives it SparseAdam, which takes its later sparse ones."""
    model = _model(sparse=True)
    opt = StageOptimizer(model.parameters(), "adam", 0.1, sparse_parameter_ids(model))
    assert opt.sparse == [True, False, False]
    model["head"](torch.ones(1, 4)).sum().backward()  # the table takes no part
    opt.step()
    _loss(model, torch.tensor([[1, 2]])).backward()
    opt.step()


def test_sparse_parameters_are_the_tables_built_sparse():
    model = nn.ModuleDict({"a": nn.EmbeddingBag(10, 2, sparse=True), "b": nn.Embedding(10, 2, sparse=True),
                           "c": nn.Embedding(10, 2), "d": nn.Linear(2, 2)})
    assert sparse_parameter_ids(model) == {id(model["a"].weight), id(model["b"].weight)}


def test_tables_of_one_row_shape_are_exchanged_as_one():
    """Two tables with rows of 4 and one with rows of 2, on two replicas: the first two are
    numbered as one (the second's rows after the first's), so the replicas all-reduce one count
    each per row shape (4), the distinct rows in that numbering (3 + 2 and 1 + 0) and the union's
    values (4 rows of 4 and 1 of 2): not a count, a `unique` and an `index_add_` per table."""
    shapes = [(10, 4), (6, 4), (5, 2)]

    def sp(rows, value, shape):
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.full((len(rows), shape[1]), value), shape)

    grads = [[sp([3, 1, 3], 1.0, shapes[0]), sp([0], 2.0, shapes[1]), sp([2], 4.0, shapes[2])],
             [sp([3], 5.0, shapes[0]), sp([5], 6.0, shapes[1]), None]]
    out, sizes = _reduce_params(shapes, grads, {0, 1, 2})
    assert sizes == [[4, 6, 18]] * 2
    for k in range(3):
        expected = sum(g[k].to_dense() for g in grads if g[k] is not None)
        for r in range(2):
            assert out[r][k].is_sparse and torch.equal(out[r][k].to_dense(), expected)
    assert [out[1][k].coalesce().indices().flatten().tolist() for k in range(3)] == [[1, 3], [0, 5], [2]]


def test_kinds_with_an_untouched_table_a_dense_gradient_and_two_dtypes():
    """Between two looked-up tables of one kind, a table no replica looked up stays without a
    gradient; a float64 table whose gradient came out dense on one replica is its own kind; every
    replica ends with the single-process sum, sparse, in each table's dtype."""
    shapes = [((10, 4), torch.float32), ((7, 4), torch.float32), ((6, 4), torch.float32), ((3, 4), torch.float64)]

    def sp(rows, value, k):
        (n, w), dtype = shapes[k]
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.full((len(rows), w), value, dtype=dtype), (n, w))

    dense = torch.zeros(3, 4, dtype=torch.float64)
    dense[1] = 7.0
    grads = [[sp([9, 9], 1.0, 0), None, sp([0], 2.0, 2), dense],
             [sp([0], 3.0, 0), None, None, sp([1, 2], 1.0, 3)]]
    out, _ = _reduce_params(shapes, grads, {0, 1, 2, 3})
    for r in range(2):
        assert out[r][1] is None
        for k in (0, 2, 3):
            expected = sum(g[k].to_dense() for g in grads if g[k] is not None)
            assert out[r][k].is_sparse and out[r][k].dtype == shapes[k][1]
            assert torch.equal(out[r][k].to_dense(), expected)
    assert out[0][3].coalesce().indices().flatten().tolist() == [1, 2]
