"""RoPE for Llama's stacked q, k and v: `qkv_heads(qkv, cos, sin, n_head, n_kv_head)` splits qkv_proj's output
into heads and rotates q and k.

Each head's halves are rotated as Hugging Face's Llama does (frequency i at columns i and i + head_dim/2):
y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin. On CUDA (Triton) that is one op, `lmyard::rope_qkv`: one kernel reads
a token's row of qkv and writes its q, k and v heads; its backward, one kernel, reads the three gradients and
writes the row of qkv's. Both compute in float32 and round once, as inductor's kernels do. Elsewhere (CPU)
the plain formula.

Design notes: docs/models.md, `lmyard/models/ops/rope.py`.
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs run the plain formula
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

NUM_WARPS = 4


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (length, head_dim) of RoPE in HF's layout: frequency i at columns i and i + head_dim/2."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, Dh) by the position's angles: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qkv_heads(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as (B, heads, T, head_dim) from qkv (B, T, (n_head + 2 n_kv_head) head_dim), q and k rotated by
    the (T, head_dim) tables."""
    B, T, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    if width == (n_head + 2 * n_kv_head) * head_dim and _fusable(qkv, cos, sin, head_dim):
        q, k, v = torch.ops.lmyard.rope_qkv(qkv, cos, sin, n_head, n_kv_head)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k, v = qkv.split([n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim], dim=-1)
    q = q.view(B, T, n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, n_kv_head, head_dim).transpose(1, 2)
    v = v.view(B, T, n_kv_head, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v


def _fusable(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernels take these: CUDA tensors with Triton, tables (T, head_dim) of qkv's length (other
    shapes go to the plain formula, whose broadcasting names the mismatch)."""
    return (
        triton is not None
        and qkv.is_cuda
        and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and cos.shape == sin.shape == (qkv.shape[1], head_dim)
        and head_dim % 2 == 0
    )


if triton is not None:

    @triton.jit
    def _rope_kernel(
        src_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, H: tl.constexpr, HKV: tl.constexpr,
        HALF: tl.constexpr, SLOTS: tl.constexpr, BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """One token's heads (a row of qkv: H query, HKV key and HKV value heads of 2 HALF). Forward: read the
        row at src_ptr and write q, k (rotated) and v. BACKWARD: read the gradients of q, k and v and write
        the row of qkv's gradient at src_ptr (the rotation by the negated angle)."""
        row = tl.program_id(0).to(tl.int64)
        t = row % T
        head = tl.arange(0, SLOTS)[:, None]  # SLOTS: H + 2 HKV rounded up to a power of two
        col = tl.arange(0, HALF)[None, :]
        is_q, is_k = head < H, (head >= H) & (head < H + HKV)
        is_v = (head >= H + HKV) & (head < H + 2 * HKV)
        q_at = q_ptr + row * H * 2 * HALF + head * 2 * HALF + col
        k_at = k_ptr + row * HKV * 2 * HALF + (head - H) * 2 * HALF + col
        v_at = v_ptr + row * HKV * 2 * HALF + (head - H - HKV) * 2 * HALF + col
        row_at = src_ptr + row * (H + 2 * HKV) * 2 * HALF + head * 2 * HALF + col
        if BACKWARD:  # each head's gradient from the one of the three it belongs to
            x1 = tl.where(is_q, tl.load(q_at, mask=is_q), tl.load(k_at, mask=is_k))
            x1 = tl.where(is_v, tl.load(v_at, mask=is_v), x1)
            x2 = tl.where(is_q, tl.load(q_at + HALF, mask=is_q), tl.load(k_at + HALF, mask=is_k))
            x2 = tl.where(is_v, tl.load(v_at + HALF, mask=is_v), x2)
        else:
            x1 = tl.load(row_at, mask=head < H + 2 * HKV, other=0.0)
            x2 = tl.load(row_at + HALF, mask=head < H + 2 * HKV, other=0.0)
        c = tl.load(cos_ptr + t * 2 * HALF + col).to(tl.float32)
        s = tl.load(sin_ptr + t * 2 * HALF + col).to(tl.float32)
        if BACKWARD:
            s = -s
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        y1, y2 = tl.where(is_v, a, a * c - b * s), tl.where(is_v, b, b * c + a * s)  # stored in the tensors' dtype
        if BACKWARD:
            tl.store(row_at, y1, mask=head < H + 2 * HKV)
            tl.store(row_at + HALF, y2, mask=head < H + 2 * HKV)
        else:
            tl.store(q_at, y1, mask=is_q)
            tl.store(q_at + HALF, y2, mask=is_q)
            tl.store(k_at, y1, mask=is_k)
            tl.store(k_at + HALF, y2, mask=is_k)
            tl.store(v_at, y1, mask=is_v)
            tl.store(v_at + HALF, y2, mask=is_v)


def _launch(src, cos, sin, q, k, v, backward: bool) -> None:
    B, T, n_head, head_dim = q.shape
    n_kv_head = k.shape[2]
    _rope_kernel[(B * T,)](
        src, cos, sin, q, k, v, T, H=n_head, HKV=n_kv_head, HALF=head_dim // 2,
        SLOTS=triton.next_power_of_2(n_head + 2 * n_kv_head), BACKWARD=backward, num_warps=NUM_WARPS,
    )  # fmt: skip


@torch.library.custom_op("lmyard::rope_qkv", mutates_args=())
def _rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    q = qkv.new_empty(B, T, n_head, head_dim)
    k, v = qkv.new_empty(B, T, n_kv_head, head_dim), qkv.new_empty(B, T, n_kv_head, head_dim)
    _launch(qkv.contiguous(), cos.contiguous(), sin.contiguous(), q, k, v, backward=False)
    return q, k, v


@_rope_qkv.register_fake
def _(qkv, cos, sin, n_head, n_kv_head):
    B, T, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    kv = qkv.new_empty(B, T, n_kv_head, head_dim)
    return qkv.new_empty(B, T, n_head, head_dim), kv, torch.empty_like(kv)


@torch.library.custom_op("lmyard::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    B, T, n_head, head_dim = grad_q.shape
    grad_qkv = grad_q.new_empty(B, T, (n_head + 2 * grad_k.shape[2]) * head_dim)
    q, k, v = (g.contiguous() for g in (grad_q, grad_k, grad_v))
    _launch(grad_qkv, cos.contiguous(), sin.contiguous(), q, k, v, backward=True)
    return grad_qkv


@_rope_qkv_backward.register_fake
def _(grad_q, grad_k, grad_v, cos, sin):
    B, T, n_head, head_dim = grad_q.shape
    return grad_q.new_empty(B, T, (n_head + 2 * grad_k.shape[2]) * head_dim)


def _setup(ctx, inputs, output) -> None:
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_q, grad_k, grad_v):
    cos, sin = ctx.saved_tensors
    return torch.ops.lmyard.rope_qkv_backward(grad_q, grad_k, grad_v, cos, sin), None, None, None, None


_rope_qkv.register_autograd(_backward, setup_context=_setup)
