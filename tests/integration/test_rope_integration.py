"""lmyard.models.ops.rope: the fused RoPE op's kernels on Llama's stacked qkv, in Triton's CPU interpreter, against
the plain formula (on CUDA: tests/unit/models/test_rope.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.integration
def test_rope_kernels_split_and_rotate_qkv_and_its_gradient_as_the_plain_formula_in_the_triton_interpreter():
    pytest.importorskip("triton")
    # The CUDA kernels' own code on CPU tensors in Triton's interpreter: the op's q, k, v and qkv's gradient
    # against the plain formula's, for head counts that fill the kernel's power-of-two rows and that do not.
    # float32: equal bit for bit; bf16: the plain formula in float32 rounded once, as the kernels round, to
    # within one bf16 step (the interpreter truncates where the GPU rounds to nearest).
    code = textwrap.dedent("""
        import torch
        import lmyard.models.ops.rope as R
        fused = R._fusable
        R._fusable = lambda *a: False  # qkv_heads takes the plain formula
        def both(qkv, cos, sin, H, Hkv, grads):
            out = []
            for run in (lambda x: [t.transpose(1, 2) for t in torch.ops.lmyard.rope_qkv(x, cos, sin, H, Hkv)],
                        lambda x: R.qkv_heads(x.float(), cos.float(), sin.float(), H, Hkv)):
                x = qkv.clone().requires_grad_()
                heads = run(x)
                sum((h.float() * g.float()).sum() for h, g in zip(heads, grads)).backward()
                out.append([h.detach().to(qkv.dtype) for h in heads] + [x.grad.to(qkv.dtype)])
            return out
        for H, Hkv, D, dtype in ((4, 2, 16, torch.float32), (5, 1, 8, torch.float32), (6, 3, 16, torch.bfloat16)):
            g = torch.Generator().manual_seed(H)
            cos, sin = (t.to(dtype) for t in R.rope_tables(D, 7, 10000.0))
            qkv = torch.randn(2, 7, (H + 2 * Hkv) * D, generator=g).to(dtype)
            grads = [torch.randn(2, n, 7, D, generator=g).to(dtype) for n in (H, Hkv, Hkv)]
            ours, plain = both(qkv, cos, sin, H, Hkv, grads)
            for name, a, b in zip(("q", "k", "v", "qkv.grad"), ours, plain):
                rtol = 0 if dtype == torch.float32 else 2**-7
                ok = a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=0)
                assert ok, (H, Hkv, dtype, name, (a.float() - b.float()).abs().max())
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
