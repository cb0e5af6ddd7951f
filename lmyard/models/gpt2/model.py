"""GPT-2 style decoder: pre-LayerNorm blocks, SDPA (flash) attention, tied embeddings.

With `doc_bos`/`doc_eos` set (model.doc_mask), attention is block-causal over the packed documents
(lmyard.models.attention); positions do not restart per document.

Initialisation follows GPT-2: N(0, 0.02) weights, zero biases, and the
residual projections scaled by 1/sqrt(2 * n_layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmyard.models import attention, mlp
from lmyard.models.base import LanguageModel
from lmyard.models.losses import linear_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    doc_bos: int | None = None  # model.doc_mask: the id that begins each packed document (None: causal)
    doc_eos: int | None = None  # model.doc_mask: the id that ends each packed document


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        # torch types Module.__setattr__ as Tensor | Module only; any other value is stored as a plain attribute
        self.c_proj.RESIDUAL = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor, mask: attention.Mask | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if mask is None:
            y = attention.causal(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        else:  # documents (the config refuses attention dropout with model.doc_mask)
            y = attention.attend(q, k, v, mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    epilogues = True  # the GELU in cuBLASLt's epilogues where mlp.fused allows (not under selective checkpointing)

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.c_proj.RESIDUAL = True  # type: ignore[assignment]  # as in CausalSelfAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.epilogues and mlp.fused(x, self.c_fc, self.c_proj):  # lmyard.models.mlp
            return mlp.gelu_mlp(x, self.c_fc, self.c_proj)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias), nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn, self.mlp = CausalSelfAttention(c), MLP(c)

    def forward(self, x: torch.Tensor, mask: attention.Mask | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(LanguageModel):
    family = "gpt2"
    config: GPTConfig

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)
        self.apply(self._init)

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks, under the name lmyard.train.distributed.parallel wraps them by (FSDP2 units, checkpointing, compile)."""
        return self.h

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(m, "RESIDUAL", False) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); with targets, only the mean cross-entropy, computed with the head in one op
        (lmyard.models.losses: the logits' gradient is made in the forward pass, in the logits' buffer)."""
        T = idx.size(1)
        assert T <= self.config.block_size, f"sequence of {T} exceeds block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.residual(self.drop(self.wte(idx) + self.wpe(pos)))
        c = self.config
        if c.doc_bos is None and c.doc_eos is None:
            for block in self.h:
                x = block(x)
        else:  # one mask per batch, shared by every block
            mask = attention.document_mask(idx, c.doc_bos, c.doc_eos)
            for block in self.h:
                x = block(x, mask)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        return linear_cross_entropy(x, self.lm_head.weight, targets)
