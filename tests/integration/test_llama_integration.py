"""The Llama model's activation checkpointing, trained and compiled: the first blocks checkpointed train exactly as
without; pointwise checkpointing keeps only a compiled block's matmul and attention outputs (the model, its
presets and memory planning: tests/unit/models/test_llama.py)."""

from __future__ import annotations

import pytest
import torch
from llama_helpers import _tiny

from lmyard.models import registry
from lmyard.models.llama.model import LlamaConfig
from lmyard.train.distributed.parallel import apply_activation_checkpointing, compile_blocks


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_checkpointing_the_first_blocks_trains_exactly_as_without(mode):
    """float64 on CPU: three AdamW steps with the first 2 of 4 blocks recomputed (whole, or selectively) give
    the very same losses, gradients and weights as keeping every activation (recomputation must not change the
    numerics)."""
    torch.set_default_dtype(torch.float64)
    try:
        runs = []
        for blocks in (None, 2):
            model = _tiny(n_layer=4)
            if blocks:
                apply_activation_checkpointing(model, mode, blocks)
                wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.layers]
                assert wrapped == [True, True, False, False]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            torch.manual_seed(1)
            losses, grads = [], []
            for _ in range(3):
                x, y = torch.randint(0, 257, (2, 64)), torch.randint(0, 257, (2, 64))
                loss = model(x, y)
                loss.backward()
                losses.append(loss.item())
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
            runs.append((losses, grads, model.state_dict()))
    finally:
        torch.set_default_dtype(torch.float32)
    (l0, g0, s0), (l1, g1, s1) = runs
    assert l0 == l1
    assert all(torch.equal(a, b) for step0, step1 in zip(g0, g1) for a, b in zip(step0, step1, strict=True))
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def _compiled_block_keeps(mode: str, c: LlamaConfig) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Bytes per token a compiled bf16 block saves for backward under checkpointing `mode` (its parameters and
    RoPE tables not counted), with its output and its input's gradient."""
    from lmyard.models.llama.model import Block
    from lmyard.models.ops.rope import rope_tables

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([Block(c).to(torch.bfloat16)])
    apply_activation_checkpointing(holder, mode)
    compile_blocks(holder)
    cos, sin = (t.to(torch.bfloat16) for t in rope_tables(c.head_dim, c.block_size, c.rope_theta))
    weights = {t.untyped_storage().data_ptr() for t in [*holder.parameters(), cos, sin]}
    x = torch.randn(1, c.block_size, c.n_embd, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = holder.layers[0](x, cos, sin)
    y.float().square().sum().backward()
    return sum(kept) / c.block_size, y.detach(), x.grad


@pytest.mark.integration
def test_pointwise_checkpointing_keeps_only_matmul_and_attention_outputs_of_a_compiled_block():
    """A compiled Llama block (bf16, CPU) under `pointwise` saves at most what the memory plan counts for it,
    at least the norms' two outputs and SwiGLU's product (4d + 2f a token) less than the compiled block without
    checkpointing, and computes the very same output and input gradient."""
    c = LlamaConfig(vocab_size=64, block_size=256, n_layer=1, n_head=8, n_embd=256, n_kv_head=2, ffn_hidden=768)
    none, y0, g0 = _compiled_block_keeps("none", c)
    pointwise, y1, g1 = _compiled_block_keeps("pointwise", c)
    figure = (
        registry.spec("llama")
        .terms({"n_embd": 256, "ffn_hidden": 768, "vocab_size": 64, "n_head": 8, "n_kv_head": 2})
        .compiled["pointwise"]
    )
    d, f = c.n_embd, c.ffn_hidden
    assert pointwise <= figure
    assert none - pointwise >= 4 * d + 2 * f
    assert torch.equal(y0, y1) and torch.equal(g0, g1)
