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


def test_making_pages_pauses_in_proportion_to_the_bytes_faulted_and_not_once_hurried(monkeypatch):
    """A pause per CHUNK faulted in keeps the training thread's share of the interpreter; a buffer of a few bytes
    (a norm's weight) pauses a few bytes' worth, not a whole chunk's (GPT-2's hundreds of small tensors made the
    buffers take seconds); once the training thread waits for them (`hurry`), there is no pause at all."""
    import mmap
    import threading

    from lmyard.checkpoint import pinned

    monkeypatch.setattr(pinned, "CHUNK", 1 << 16)
    pauses: list[float] = []
    monkeypatch.setattr(pinned.time, "sleep", pauses.append)

    def populate(nbytes: int, hurry: threading.Event | None = None) -> list[float]:
        pauses.clear()
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        pinned._populate(pages, torch.frombuffer(pages, dtype=torch.uint8), hurry)
        return list(pauses)

    assert populate(2 * pinned.CHUNK + pinned.CHUNK // 4) == pytest.approx([pinned.PAUSE_S] * 2 + [pinned.PAUSE_S / 4])
    assert sum(populate(4096)) == pytest.approx(pinned.PAUSE_S * 4096 / pinned.CHUNK)
    hurry = threading.Event()
    hurry.set()
    assert populate(3 * pinned.CHUNK, hurry) == []
