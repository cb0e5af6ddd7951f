"""The Llama tests' tiny model."""

from __future__ import annotations

import torch

from lmyard.config import ModelConfig
from lmyard.models.llama.model import Llama
from lmyard.models.registry import build_model


def _tiny(**kw) -> Llama:
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="llama-tiny", **kw), 257)
