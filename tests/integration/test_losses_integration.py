"""The fused LM head + cross-entropy op (lmyard.models.losses) compiled and in Triton's interpreter, against the
plain path (eager: tests/unit/models/test_losses.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from lmyard.models.gpt2.model import GPT
from lmyard.models.registry import model_config


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
