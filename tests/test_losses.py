"""The fused LM head + cross-entropy op (lmyard.models.losses) against the plain two-op path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from lmyard.models.gpt2.model import GPT
from lmyard.models.losses import linear_cross_entropy
from lmyard.models.registry import model_config


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


@pytest.mark.integration
def test_model_loss_is_the_mean_cross_entropy_of_its_logits_and_compiles():
    torch.manual_seed(0)
    from lmyard.config import ModelConfig

    model = GPT(model_config(ModelConfig(preset=None, n_layer=2, n_head=2, n_embd=32, block_size=16), 257))
    x = torch.randint(0, 257, (2, 16))
    y = torch.roll(x, -1, 1)
    plain = F.cross_entropy(model(x).reshape(-1, 320), y.reshape(-1))
    assert torch.allclose(model(x, y), plain, atol=1e-5)
    assert torch.allclose(torch.compile(model)(x, y), plain, atol=1e-4)  # the op traces (fake impl) under compile


@pytest.mark.integration
@pytest.mark.parametrize("block", [128, 512], ids=["several-blocks-a-row", "one-block-a-row"])
def test_triton_kernel_matches_the_torch_path_in_the_triton_interpreter(block):
    pytest.importorskip("triton")
    # The CUDA kernel's own code, run on CPU tensors by Triton's interpreter (set before triton is imported).
    # 300-wide rows: in blocks of 128 (not a multiple), or in one masked block; bf16 logits written over in place.
    code = textwrap.dedent("""
        import sys
        import torch
        import lmyard.models.ops.cross_entropy as L
        L.BLOCK = int(sys.argv[1])
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(6, 300, generator=g) * 4).to(torch.bfloat16)
        targets = torch.tensor([0, 299, 127, 128, 5, 256])
        a, b = logits.clone(), logits.clone()
        la = L.loss_and_grad_triton(a, targets, True)
        lb = L.loss_and_grad_torch(b, targets, True)
        assert torch.allclose(la, lb, atol=1e-4), (la, lb)
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-5), (a - b).abs().max()
        assert a.float().sum(1).abs().max() < 1e-3  # each row of (softmax - onehot) / n sums to zero
        c = logits.clone()
        assert torch.allclose(L.loss_and_grad_triton(c, targets, False), lb, atol=1e-4)
        assert torch.equal(c, logits)  # without the gradient the logits are left alone
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(block)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
