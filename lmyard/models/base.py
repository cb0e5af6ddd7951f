"""What every family's nn.Module shares: AdamW parameter groups and sampling, and the autocast of every forward
(`autocast`: the trainer's, the val loss's and the evaluator's).

A family's model subclasses LanguageModel and has `config` (its frozen config dataclass, with
`block_size`), `family` (its `model.arch`), `layers` (the ModuleList of blocks that
lmyard.train.distributed.parallel wraps one by one) and `forward(idx, targets=None)`: logits (B, T, V), or with
targets only the mean cross-entropy (lmyard.models.losses.linear_cross_entropy).
"""

from __future__ import annotations

import contextlib
from typing import ClassVar, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


def autocast(device: torch.device | str):
    """The context of a forward pass: bf16 autocast on CUDA (the weights stay fp32), nothing elsewhere."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ModelConfig(Protocol):
    """What every family's config dataclass has (read-only: the dataclasses are frozen)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_embd(self) -> int: ...


class LanguageModel(nn.Module):
    """The shared part of every family's model (see the module docstring)."""

    family: ClassVar[str]  # model.arch: lmyard.models.registry.spec_of(model) finds the family's spec by it
    config: ModelConfig  # each family narrows it to its own dataclass
    residual_dtype: torch.dtype | None = None  # train.residual_dtype under autocast; None: the embedding's dtype

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding's output as the residual stream the blocks add to (`residual_dtype`)."""
        return x if self.residual_dtype is None else x.to(self.residual_dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay on matrices (weights, embeddings, head); none on biases and norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Sample continuations; `vocab_limit` masks the padding rows above the tokenizer's vocabulary."""
        for _ in range(max_new_tokens):
            cond = idx[:, -self.config.block_size :]
            logits = self(cond)
            logits = logits[:, -1, :].float() / temperature
            if vocab_limit is not None:
                logits[:, vocab_limit:] = -float("inf")
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
        return idx
