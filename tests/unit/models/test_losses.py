"""The fused LM head + cross-entropy op (lmyard.models.losses) against the plain two-op path (compiled and in
Triton's interpreter: tests/integration/test_losses_integration.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmyard.models.losses import linear_cross_entropy


def _inputs(n=48, d=24, v=333, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    return x, w, torch.randint(0, v, (n,), generator=g)


def _loss_and_grads(loss_fn, x, w, y, upstream=0.37):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = loss_fn(x, w, y)
    (loss * upstream).backward()  # an upstream gradient other than 1, as with gradient accumulation
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_head_loss_and_gradients_equal_cross_entropy_of_the_product(seed):
    x, w, y = _inputs(dtype=torch.float64, seed=seed)
    fused = _loss_and_grads(linear_cross_entropy, x, w, y)
    plain = _loss_and_grads(lambda a, b, t: F.cross_entropy(a @ b.t(), t), x, w, y)
    assert abs(fused[0].item() - plain[0].item()) < 1e-5  # the softmax runs in fp32
    for f, p in zip(fused[1:], plain[1:]):
        assert torch.linalg.norm(f - p) / torch.linalg.norm(p) < 1e-5


def test_fused_head_under_bf16_autocast_matches_the_autocast_linear_and_cross_entropy():
    x, w, y = _inputs(n=64, d=32, v=500)

    def autocast(fn):
        def run(a, b, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(a, b, t)

        return run

    fused = _loss_and_grads(autocast(linear_cross_entropy), x, w, y)
    plain = _loss_and_grads(autocast(lambda a, b, t: F.cross_entropy(F.linear(a, b).float(), t)), x, w, y)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == fused[2].dtype == torch.float32
    assert abs(fused[0].item() - plain[0].item()) < 1e-3
    for f, p in zip(fused[1:], plain[1:]):
        assert torch.linalg.norm(f - p) / torch.linalg.norm(p) < 2e-2  # bf16 products


def test_fused_head_without_gradients_gives_the_same_loss():
    x, w, y = _inputs()
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(x, w, y), F.cross_entropy(x @ w.t(), y), atol=1e-5)
