"""The one place a model is made: `build_model(cfg.model, n_vocab)` gives a GPT-2 (lmyard.model) or a
Llama (lmyard.llama) by `model.arch`; `model_spec`/`model_from_spec` carry its shape through a checkpoint."""

from __future__ import annotations

import dataclasses

import torch

from lmyard.config import ModelConfig
from lmyard.models.gpt2 import GPT, GPTConfig
from lmyard.models.llama import Llama, LlamaConfig

ARCHS = {"gpt2": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def model_config(cfg: ModelConfig, n_vocab: int) -> GPTConfig | LlamaConfig:
    """The resolved shape of the configured architecture; vocab defaults to n_vocab rounded up to 64."""
    _, config_cls = ARCHS[cfg.architecture()]
    return config_cls.from_config(cfg, n_vocab)


def build_model(cfg: ModelConfig, n_vocab: int) -> torch.nn.Module:
    """A freshly initialised GPT or Llama (on the current default device: build under `with torch.device(...)`
    to make the weights there)."""
    model_cls, _ = ARCHS[cfg.architecture()]
    return model_cls(model_config(cfg, n_vocab))


def model_spec(model: torch.nn.Module) -> dict:
    """The architecture and its config fields, JSON-able: what a checkpoint records to rebuild the model."""
    arch = next(name for name, (cls, _) in ARCHS.items() if isinstance(model, cls))
    return {"arch": arch, **dataclasses.asdict(model.config)}


def model_from_spec(spec: dict) -> torch.nn.Module:
    """The model of `model_spec`'s dict (without `arch`: a GPT-2, as checkpoints written before Llama say)."""
    fields = dict(spec)
    model_cls, config_cls = ARCHS[fields.pop("arch", "gpt2")]
    return model_cls(config_cls(**fields))
