"""Values across stage boundaries: which dimension follows the batch, and messages that carry
any dtype and any memory layout."""

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.runtime.boundary import layouts, pack, packed_bytes, unpack


def test_layouts_find_the_batch_dimension_of_every_value():
    h2, h3 = torch.randn(2, 5, 8, requires_grad=True), torch.randn(3, 5, 8)
    labels2, labels3 = torch.zeros(2 * 5, dtype=torch.long), torch.zeros(3 * 5, dtype=torch.long)  # flattened B*S
    mask2 = mask3 = torch.ones(1, 1, 5, 5, dtype=torch.bool)  # the same for every slice
    seq_first2, seq_first3 = torch.randn(5, 2, 4), torch.randn(5, 3, 4)
    lays = layouts(["h", "labels", "mask", "sf"], [h2 * 1, labels2, mask2, seq_first2], 2,
                   [h3, labels3, mask3, seq_first3], 3)
    assert [(lay.batch_dim, lay.per_row, lay.grad) for lay in lays] == [(0, 1, True), (0, 5, False),
                                                                          (None, 0, False), (1, 1, False)]
    assert lays[1].shape_for(4) == (20,) and lays[2].shape_for(4) == (1, 1, 5, 5) and lays[3].shape_for(4) == (5, 4, 4)
    assert torch.equal(lays[1].take(torch.arange(10), 1, 2), torch.arange(5, 10))
    with pytest.raises(HetplanError, match="one dimension proportional to the batch"):
        layouts(["x"], [torch.zeros(2, 2)], 2, [torch.zeros(3, 3)], 3)


def test_a_message_carries_any_dtype_and_layout_and_comes_back_equal():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    values = [base.t()[1:3],  # a non-contiguous view
              torch.tensor([[True, False, True]]), torch.arange(5, dtype=torch.int64),
              torch.randn(3, dtype=torch.float16), torch.empty(0, 4), torch.tensor(7, dtype=torch.int32)]
    buf = pack(values)
    metas = [(v.dtype, tuple(v.shape)) for v in values]
    assert buf.dtype == torch.uint8 and buf.numel() == packed_bytes(metas)
    out = unpack(buf, metas)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(out, values, strict=True))
    assert out[0].is_contiguous() and out[0].data_ptr() != base.data_ptr()
    assert pack([]).numel() == 1 == packed_bytes([])  # an empty message is one byte, still sent
