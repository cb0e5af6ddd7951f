"""lmyard's own Triton kernels compiled beside the rank, before its first step needs them.

The fused cross-entropy, Llama's RoPE, the AdamW step and the gradient norm are Triton `@jit` functions that
the compile cache (lmyard.train.compile_cache) does not hold: each compiles on its first launch, in the first
step, where the node's Triton cache lacks it.

    with started(model_config, device, local_rank):   a child compiles them while the rank compiles the model
        trainer.train()

Nothing waits for the child; it is stopped when the block ends. Design notes: docs/training.md ("lmyard's own
kernels, compiled ahead"), `lmyard/train/kernel_warmup.py`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import torch


def shapes(model_config) -> dict:
    """What decides which kernels the step launches: the model's vocabulary, its heads and sequence length."""
    c = model_config
    n_kv_head = getattr(c, "n_kv_head", None)
    rope = n_kv_head is not None and hasattr(c, "head_dim")
    return {
        "vocab": c.vocab_size,
        "rope": [c.n_head, n_kv_head, c.head_dim, c.block_size] if rope else None,
    }


@contextlib.contextmanager
def started(model_config, device: torch.device, local_rank: int) -> Iterator[subprocess.Popen | None]:
    """The child for the node (local rank 0 on CUDA with Triton; None elsewhere), stopped at the block's end if
    it still runs."""
    proc = None
    if device.type == "cuda" and local_rank == 0 and _has_triton():
        args = json.dumps({**shapes(model_config), "device": device.index or 0})
        cmd = [sys.executable, "-m", "lmyard.train.kernel_warmup", args]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def warm(vocab: int, rope: list[int] | None, device: torch.device) -> None:
    """Each kernel once, in the order the first step launches them, then the variants it launches later or
    under other settings (evaluation, bf16 parameters, float32 logits)."""
    from lmyard.models.ops.cross_entropy import loss_and_grad_triton

    def cross_entropy(dtype: torch.dtype, write_grad: bool) -> None:
        logits = torch.zeros(2, vocab, dtype=dtype, device=device)
        loss_and_grad_triton(logits, torch.zeros(2, dtype=torch.long, device=device), write_grad)

    if rope is not None:
        _rope(rope, torch.float32, device)
    cross_entropy(torch.bfloat16, True)
    _optimizer(torch.float32, device)
    cross_entropy(torch.bfloat16, False)
    if rope is not None:
        _rope(rope, torch.bfloat16, device)
    _optimizer(torch.bfloat16, device)
    cross_entropy(torch.float32, True)
    cross_entropy(torch.float32, False)
    torch.cuda.synchronize(device)


def _rope(sizes: list[int], table_dtype: torch.dtype, device: torch.device) -> None:
    """The forward and backward kernels on one sequence: qkv in bf16 (autocast's, FSDP2's), tables in the
    residual stream's dtype."""
    from lmyard.models.ops.rope import qkv_heads, rope_tables

    n_head, n_kv_head, head_dim, length = sizes
    width = (n_head + 2 * n_kv_head) * head_dim
    qkv = torch.zeros(1, length, width, dtype=torch.bfloat16, device=device, requires_grad=True)
    cos, sin = (t.to(device=device, dtype=table_dtype) for t in rope_tables(head_dim, length, 10000.0))
    q, k, v = qkv_heads(qkv, cos, sin, n_head, n_kv_head)
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()


def _optimizer(dtype: torch.dtype, device: torch.device) -> None:
    """The gradient norm and the AdamW step of parameters in `dtype` (bf16: with float32 masters)."""
    from lmyard.train.optim import AdamW, clipped_update

    params: list[torch.Tensor] = [torch.nn.Parameter(torch.zeros(4, 4, dtype=dtype, device=device)) for _ in range(2)]
    for p in params:
        p.grad = torch.zeros_like(p)
    clipped_update(params, AdamW(params, lr=1e-3, weight_decay=0.1), 1.0)


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    torch.cuda.set_device(given["device"])
    warm(given["vocab"], given["rope"], torch.device("cuda", given["device"]))
