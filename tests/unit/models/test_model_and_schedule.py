"""The GPT model and the learning-rate schedule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmyard.config import ModelConfig, TrainConfig
from lmyard.models.gpt2.model import GPT
from lmyard.models.registry import build_model, model_config
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


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_bf16_residual_stream_reaches_every_block_in_bf16_and_keeps_the_loss(family):
    """train.residual_dtype=bfloat16: under bf16 autocast the blocks add to a bf16 stream (float32 without it);
    the loss moves by bf16 rounding only."""
    torch.manual_seed(0)
    cfg = ModelConfig(preset=None, arch=family, n_layer=2, n_head=2, n_embd=32, block_size=16)
    model = build_model(cfg, 257)
    x = torch.randint(0, 257, (3, 16))
    seen: list[torch.dtype] = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    losses = {}
    for dtype in (None, torch.bfloat16):
        model.residual_dtype = dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[dtype] = model(x, torch.roll(x, -1, 1)).float().item()
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert abs(losses[torch.bfloat16] - losses[None]) < 0.02 * losses[None]


def _prepared(residual: str, device: str) -> GPT:
    from lmyard.recipes import load_recipe
    from lmyard.train.distributed.parallelism import prepare_model

    over = [f"train.residual_dtype={residual}", "train.compile=false", "train.activation_checkpointing=none"]
    torch.manual_seed(0)
    model = _tiny().to(device)
    prepare_model(
        model, load_recipe("smoke", over), SimpleNamespace(world=1, local_rank=0, device=torch.device(device))
    )
    return model


def test_on_a_cpu_the_residual_stream_stays_float32_whatever_train_residual_dtype_says():
    assert _prepared("bfloat16", "cpu").residual_dtype is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_train_residual_dtype_bfloat16_carries_the_stream_in_bf16_under_autocast():
    from lmyard.models.base import autocast

    x = torch.randint(0, 257, (3, 16), device="cuda")
    losses = {}
    for residual in ("auto", "bfloat16"):
        model = _prepared(residual, "cuda")
        with autocast("cuda"):
            losses[residual] = model(x, torch.roll(x, -1, 1)).item()
    assert model.residual_dtype == torch.bfloat16
    assert abs(losses["bfloat16"] - losses["auto"]) < 0.02 * losses["auto"]


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
