"""GPT-2's MLP with its GELU in cuBLASLt's epilogues (lmyard.models.mlp), compiled, against the plain ops (eager and
on CUDA: tests/unit/models/test_mlp.py)."""

from __future__ import annotations

import pytest
from mlp_helpers import test_gelu_mlp_output_and_gradients_equal_the_plain_mlp  # noqa: F401  on this module's `compiled`


@pytest.fixture(params=[True])  # eager: tests/unit/models/test_mlp.py
def compiled(request):
    return request.param
