"""The attention kernel inside a compiled model's graph: inductor's cache does not hand one model.attention's
graph to a run of another (FlashAttention-4, model.attention=fa4: tests/unit/models/test_flash4.py)."""

from __future__ import annotations

import pytest
import torch

from lmyard.config import ModelConfig
from lmyard.models.registry import build_model
from lmyard.train.distributed.parallelism import ComputeContext


def _compiled_attention_ops(model, idx, choice: str) -> set[str]:
    torch._dynamo.reset()  # a fresh trace: only inductor's cache can hand back an earlier graph
    with torch.no_grad(), ComputeContext(False, choice), torch.profiler.profile() as prof:
        torch.compile(model)(idx)
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.integration
def test_a_compiled_model_runs_the_attention_kernel_asked_for_even_where_a_cached_graph_used_another():
    """The choice sits inside the model's graph (lmyard.models.attention.causal), so inductor's cache, which
    keys a graph by its trace, does not serve the graph of one model.attention to a run of another."""
    model = build_model(ModelConfig(preset="llama-tiny"), 257).eval()
    idx = torch.randint(0, 257, (2, 64))
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert flash in _compiled_attention_ops(model, idx, "flash")
    assert flash not in _compiled_attention_ops(model, idx, "math")  # math: decomposed into inductor's kernels
    assert flash in _compiled_attention_ops(model, idx, "flash")
