"""The GPT model and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from lmyard.config import ModelConfig, TrainConfig
from lmyard.models.gpt2.model import GPT
from lmyard.models.registry import model_config
from lmyard.train.trainer import lr_at


def _tiny(vocab=257):
    return GPT(model_config(ModelConfig(preset=None, n_layer=2, n_head=2, n_embd=32, block_size=16), vocab))


def test_vocab_is_padded_to_a_multiple_of_64():
    assert _tiny(257).config.vocab_size == 320
    assert _tiny(50257).config.vocab_size == 50304


def test_initial_loss_is_near_uniform_and_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = _tiny()
    x = torch.randint(0, 257, (3, 16))
    assert model(x).shape == (3, 16, 320)
    loss = model(x, torch.roll(x, -1, 1))
    assert abs(loss.item() - math.log(320)) < 0.3
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_embedding_and_output_weights_are_tied():
    model = _tiny()
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


def test_weight_decay_applies_to_matrices_only():
    decay, no_decay = _tiny().param_groups(0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_causal_attention_ignores_future_tokens():
    torch.manual_seed(0)
    model = _tiny().eval()
    x = torch.randint(0, 257, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 257
    a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    t = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.55)  # halfway: floor + (1 - floor) / 2
    assert lr_at(110, t) == pytest.approx(0.1)
    assert lr_at(500, t) == pytest.approx(0.1)
    assert all(lr_at(s, t) >= lr_at(s + 1, t) for s in range(10, 120))
