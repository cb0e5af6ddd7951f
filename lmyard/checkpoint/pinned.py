"""Page-locked host buffers for checkpoint copies, made without stalling the training thread.

Design notes: docs/checkpoints.md, `lmyard/checkpoint/pinned.py`.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
import weakref

import torch

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14: fault pages in, writable
CHUNK = 64 << 20  # pages are faulted in this many bytes at a time
PAUSE_S = 0.02  # a pause after each chunk (in proportion for less): madvise holds the interpreter while it faults


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _populate(pages: mmap.mmap, flat: torch.Tensor, hurry: threading.Event | None) -> None:
    """Fault every page of `pages` in, CHUNK bytes at a time (madvise; writing zeros where it is refused), pausing
    PAUSE_S per CHUNK faulted (a small buffer, a short pause) until `hurry` is set."""
    for start in range(0, len(pages), CHUNK):
        size = min(CHUNK, len(pages) - start)
        try:
            pages.madvise(_MADV_POPULATE_WRITE, start, size)
        except (OSError, ValueError):  # an older kernel
            flat[start : start + size].zero_()
        if PAUSE_S and not (hurry is not None and hurry.is_set()):
            time.sleep(PAUSE_S * size / CHUNK)


def pinned_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, hurry: threading.Event | None = None
) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in page-locked memory (ordinary memory without CUDA). Its making
    pauses so that a training thread beside it keeps the interpreter, unless `hurry` is set: the training thread
    itself waits for the buffer (a checkpoint is due), and a pause would only stretch that wait."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # keeps `pages` alive
    _populate(pages, flat, hurry)
    out = flat.view(dtype).view(shape)
    ptr = out.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) != 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # torch's own allocation, stall and all
    weakref.finalize(pages, _unregister, ptr)  # when the last tensor on these pages is freed
    return out
