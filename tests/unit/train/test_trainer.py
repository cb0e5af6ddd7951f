"""The trainer's batch: one that does not divide names a valid size (the trainer's runs: exact resume, world-size
changes, the divergence guard, gradient accumulation: tests/integration/test_trainer_integration.py)."""

from __future__ import annotations

import pytest

from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.train.build import grad_accum_steps


def test_batch_that_does_not_divide_names_a_valid_size():
    cfg = load_recipe("smoke", ["train.batch_tokens=5000"])
    with pytest.raises(UserError, match=r"multiple of micro_batch \* block_size \* world size .* = 4096"):
        grad_accum_steps(cfg, 2, 128)
