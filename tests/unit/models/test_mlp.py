"""GPT-2's MLP with its GELU in cuBLASLt's epilogues (lmyard.models.mlp) against the plain ops (compiled:
tests/integration/test_mlp_integration.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from mlp_helpers import (
    _mlp,
    _out_and_grads,
    _plain,
    _rel,
    test_gelu_mlp_output_and_gradients_equal_the_plain_mlp,  # noqa: F401  on this module's `compiled`
)

from lmyard.models import mlp
from lmyard.models.ops import cublaslt


@pytest.fixture(params=[False])  # compiled: tests/integration/test_mlp_integration.py
def compiled(request):
    return request.param


def test_gelu_mlp_is_taken_only_for_training_under_16_bit_autocast_on_cuda():
    fc, proj = _mlp()
    x = torch.randn(2, 48)
    assert not mlp.fused(x, fc, proj)  # CPU
    no_bias = nn.Linear(48, 192, bias=False)
    assert not mlp.fused(x, no_bias, proj)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLASLt)")
@pytest.mark.parametrize("compiled", [False, True])
def test_gelu_mlp_on_cuda_runs_cublaslt_epilogues_and_matches_the_plain_mlp_under_bf16_autocast(compiled):
    fc, proj = (m.cuda() for m in _mlp(d=256))
    x = torch.randn(8, 128, 256, device="cuda")

    def under_autocast(fn):
        def run(a):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(a)

        return torch.compile(run) if compiled else run

    cublaslt._PLANS.clear()
    got = _out_and_grads(under_autocast(lambda a: mlp.gelu_mlp(a, fc, proj)), x, fc, proj)
    want = _out_and_grads(under_autocast(_plain(fc, proj)), x, fc, proj)
    assert cublaslt.planned() == {"gelu_aux_bias", "dgelu"}
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and _rel(g, w) < 1e-2  # bf16 products, rounded at other points


def test_gelu_mlp_is_not_taken_for_float8_linears_or_with_the_switch_off(monkeypatch):
    class Float8Like(nn.Linear):  # torchao's Float8Linear subclasses nn.Linear and must keep its own forward
        pass

    fc, proj = _mlp()
    x = torch.randn(2, 48)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the other conditions as on CUDA
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda *a: torch.bfloat16)
    assert mlp.fused(x, fc, proj)
    assert not mlp.fused(x, Float8Like(48, 192), proj)
    monkeypatch.setattr(mlp, "ENABLED", False)
    assert not mlp.fused(x, fc, proj)


@pytest.mark.parametrize("mode,epilogues", [("selective", False), ("pointwise", False), ("full", True)])
def test_op_level_checkpointing_keeps_gpt2s_mlp_on_plain_ops_so_its_policy_sees_the_matmuls(mode, epilogues):
    from lmyard.models.gpt2.model import GPT, GPTConfig
    from lmyard.train.distributed.parallel import apply_activation_checkpointing

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16))
    apply_activation_checkpointing(model, mode, blocks=2)
    assert [block.mlp.epilogues for block in model.h] == [epilogues, epilogues, True]  # the third is not wrapped
