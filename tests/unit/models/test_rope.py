"""lmyard.models.ops.rope: the fused RoPE op on Llama's stacked qkv against the plain formula, on CUDA (its kernels
in Triton's interpreter: tests/integration/test_rope_integration.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_llama_block_on_cuda_trains_with_the_fused_rope_as_with_the_plain_formula(compiled, monkeypatch):
    """A bf16 Llama block: the fused op ran (the profiler sees its kernel), and the output and every gradient
    match the plain formula's to bf16's rounding."""
    import lmyard.models.ops.rope as R
    from lmyard.models.llama.model import Block, LlamaConfig

    c = LlamaConfig(vocab_size=64, block_size=256, n_layer=1, n_head=8, n_embd=512, n_kv_head=2, ffn_hidden=1024)
    torch.manual_seed(0)
    block = Block(c).cuda().to(torch.bfloat16)
    cos, sin = (t.cuda().to(torch.bfloat16) for t in R.rope_tables(c.head_dim, 256, c.rope_theta))
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)

    fusable = R._fusable

    def run(fused: bool):
        monkeypatch.setattr(R, "_fusable", fusable if fused else lambda *a: False)
        torch._dynamo.reset()
        f = torch.compile(block) if compiled else block
        xi = x.clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = f(xi, cos, sin)
            y.float().square().mean().backward()
            torch.cuda.synchronize()
        kernels = {e.name for e in prof.events()}
        grads = [xi.grad] + [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return y.detach(), grads, any("_rope_kernel" in k for k in kernels)

    y0, g0, ran0 = run(False)
    y1, g1, ran1 = run(True)
    assert ran1 and not ran0
    assert (y1.float() - y0.float()).abs().max().item() < 0.05
    for a, b in zip(g1, g0):
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.999
