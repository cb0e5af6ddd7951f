"""The cross-entropy's gradient in the logits' own buffer: `loss_and_grad(logits, targets, write_grad)`.

On CUDA one Triton kernel reads each row of logits, finds its log-sum-exp, and overwrites the row with
`(softmax - onehot) / N` (lmyard.models.losses.linear_cross_entropy calls it in its forward pass); elsewhere
(CPU, or no Triton) the same contract in torch. `triton = None` here keeps the torch path everywhere
(tests/benchmarks/bench_parity.py's switch); BLOCK and NUM_WARPS are the kernel's launch settings
(tests/benchmarks/bench_lm_head.py --sweep).
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096  # columns per load (8 KB of a bf16 row) and warps per row: the fastest of a sweep on H200
NUM_WARPS = 4  # (tests/benchmarks/bench_lm_head.py --sweep); the whole row in one block was slower


if triton is not None:

    @triton.jit
    def _ce_grad_kernel(
        logits_ptr,
        stride,
        targets_ptr,
        loss_ptr,
        scale,
        N_COLS: tl.constexpr,
        BLOCK: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
    ):
        """One program per row: loss = lse - logit[target]; row <- (softmax - onehot) * scale."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        target = tl.load(targets_ptr + row)
        # block by block: an online max and sum, then a second pass over the row (still in L2)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for off in range(0, N_COLS, BLOCK):
            x = tl.load(base + off + cols, mask=off + cols < N_COLS, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        if WRITE_GRAD:
            for off in range(0, N_COLS, BLOCK):
                mask = off + cols < N_COLS
                x = tl.load(base + off + cols, mask=mask, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                p = tl.where(off + cols == target, p - 1.0, p)
                tl.store(base + off + cols, (p * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def loss_and_grad_triton(logits: torch.Tensor, targets: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """Per-row losses (fp32); with `write_grad`, `logits` is overwritten by d(mean loss)/d(logits)."""
    n, v = logits.shape
    losses = torch.empty(n, device=logits.device, dtype=torch.float32)
    _ce_grad_kernel[(n,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        1.0 / n,
        N_COLS=v,  # one build per vocabulary
        BLOCK=BLOCK,
        WRITE_GRAD=write_grad,
        num_warps=NUM_WARPS,
    )
    return losses


def loss_and_grad_torch(logits: torch.Tensor, targets: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """The same contract as the kernel, in torch (CPU, or no Triton)."""
    n = logits.size(0)
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    losses = lse - lf.gather(1, targets[:, None]).squeeze(1)
    if write_grad:
        grad = torch.exp(lf - lse[:, None])
        grad[torch.arange(n, device=logits.device), targets] -= 1.0
        logits.copy_(grad.mul_(1.0 / n))
    return losses


def loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """Per-row losses (fp32) of (n, V) logits; with `write_grad`, `logits` is overwritten by d(mean loss)/d(logits):
    the Triton kernel on CUDA, torch elsewhere."""
    if triton is not None and logits.is_cuda:
        return loss_and_grad_triton(logits, targets, write_grad)
    return loss_and_grad_torch(logits, targets, write_grad)
