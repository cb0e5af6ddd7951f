"""The checkpoint copies' page-locked host buffers (lmyard.checkpoint.pinned)."""

from __future__ import annotations

import gc

import pytest
import torch

from lmyard.checkpoint.pinned import pinned_empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_buffer_has_the_shape_and_dtype_asked_for_and_holds_what_is_written(dtype):
    buf = pinned_empty((3, 5, 7), dtype)
    assert (buf.shape, buf.dtype, buf.device.type, buf.is_contiguous()) == ((3, 5, 7), dtype, "cpu", True)
    src = torch.arange(105).reshape(3, 5, 7).to(dtype)
    buf.copy_(src)
    assert torch.equal(buf, src)
    assert pinned_empty((0, 4), dtype).shape == (0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_buffer_is_page_locked_takes_an_asynchronous_copy_exactly_and_stays_locked_while_a_view_lives():
    src = torch.randn(1024, 4096, device="cuda")
    buf = pinned_empty(src.shape, src.dtype)
    assert buf.is_pinned()
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())
    view = buf[7:9]
    del buf
    gc.collect()
    assert view.is_pinned() and torch.equal(view, src[7:9].cpu())
