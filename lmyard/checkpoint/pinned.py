"""Page-locked host buffers for checkpoint copies, made without stalling the training thread.

torch's pinned allocation (`torch.empty(..., pin_memory=True)`, cudaHostAlloc) faults in and zero-fills the
pages while it holds the CUDA driver, so every kernel launch of the training thread waits meanwhile: making
the buffers of llama-1b's 18 GB state (fp32 weights and AdamW moments) in a background thread after the
first step cost the steps it overlapped 9.1 s on an H200 (tests/benchmarks/bench_first_steps.py). Here the
pages are an anonymous mapping faulted in as ordinary memory, 64 MiB at a time with a 20 ms pause after each
(the fault-in holds Python's interpreter lock, which the training thread needs too), then registered with
CUDA (`cudaHostRegister`): the same buffers cost those steps 0.4-0.5 s; the pauses add about 6 s to their
making at 18 GB (the first checkpoint is due far later). The mapping is the buffer's own (page-aligned,
shared with nothing), so its registration cannot overlap another's; it is unregistered when the last tensor
on it is freed.

Without CUDA (or where registration fails) a buffer is ordinary memory: copies into it are then synchronous,
and correct.
"""

from __future__ import annotations

import math
import mmap
import time
import weakref

import torch

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14: fault pages in, writable
CHUNK = 64 << 20  # pages are faulted in this many bytes at a time
PAUSE_S = 0.02  # a pause after each chunk: madvise holds the interpreter while it faults a chunk in


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _populate(pages: mmap.mmap, flat: torch.Tensor) -> None:
    """Fault every page of `pages` in, CHUNK bytes at a time (madvise; writing zeros where it is refused)."""
    for start in range(0, len(pages), CHUNK):
        size = min(CHUNK, len(pages) - start)
        try:
            pages.madvise(_MADV_POPULATE_WRITE, start, size)
        except (OSError, ValueError):  # an older kernel
            flat[start : start + size].zero_()
        if PAUSE_S:
            time.sleep(PAUSE_S)


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor in page-locked memory (ordinary memory without CUDA)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # keeps `pages` alive
    _populate(pages, flat)
    out = flat.view(dtype).view(shape)
    ptr = out.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) != 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # torch's own allocation, stall and all
    weakref.finalize(pages, _unregister, ptr)  # when the last tensor on these pages is freed
    return out
