"""GPT-2's MLP with its GELU in cuBLASLt's epilogues (lmyard.models.mlp), compiled, against the plain ops (eager and
on CUDA: tests/unit/models/test_mlp.py)."""

from __future__ import annotations

import pytest
import torch
from mlp_helpers import _mlp, _out_and_grads, _plain, _rel

from lmyard.models import mlp


@pytest.mark.parametrize("compiled", [True])  # eager: tests/unit/models/test_mlp.py
def test_gelu_mlp_output_and_gradients_equal_the_plain_mlp(compiled):
    fc, proj = _mlp()
    x = torch.randn(3, 7, 48, dtype=torch.float64)
    fc, proj = fc.double(), proj.double()
    fused = (
        (lambda a: mlp.gelu_mlp(a, fc, proj)) if not compiled else torch.compile(lambda a: mlp.gelu_mlp(a, fc, proj))
    )
    got, want = _out_and_grads(fused, x, fc, proj), _out_and_grads(_plain(fc, proj), x, fc, proj)
    for g, w in zip(got, want):
        assert g.shape == w.shape and _rel(g, w) < 1e-12
