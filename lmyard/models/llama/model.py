"""Llama-family decoder (Llama 3 shapes): RoPE, RMSNorm, SwiGLU, grouped-query attention, untied
embeddings, no biases.

The interface is lmyard.models.base.LanguageModel's: `forward(idx, targets=None)` gives the mean loss
through lmyard.models.losses.linear_cross_entropy (the logits without targets), `num_params()`,
`param_groups()`, `generate()`, `config.block_size`, and `layers`, the ModuleList of blocks that
lmyard.train.distributed.parallel wraps one by one (FSDP2 units, activation checkpointing, torch.compile).

Design notes: docs/models.md, `lmyard/models/llama/model.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmyard.models import attention
from lmyard.models.base import LanguageModel
from lmyard.models.losses import linear_cross_entropy
from lmyard.models.ops.rope import qkv_heads, rope_tables


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int
    ffn_hidden: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    doc_bos: int | None = None  # model.doc_mask: the id that begins each packed document (None: causal)
    doc_eos: int | None = None  # model.doc_mask: the id that ends each packed document

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.sizes = [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim]
        self.qkv_proj = nn.Linear(c.n_embd, sum(self.sizes), bias=False)  # HF's q_proj, k_proj, v_proj stacked
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: attention.Mask | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = qkv_heads(self.qkv_proj(x), cos, sin, self.n_head, self.n_kv_head)
        if mask is None:
            y = attention.causal(q, k, v, enable_gqa=self.n_kv_head != self.n_head)
        else:
            y = attention.attend(q, k, v, mask, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.n_embd, c.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(c.n_embd, c.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(c.ffn_hidden, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.mlp = MLP(c)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: attention.Mask | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHead(nn.Linear):
    """The output projection; with targets, the projection and its cross-entropy in one op (lmyard.models.losses).
    Called as a module, so FSDP2 gathers its weight through its own unit's hooks."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets)


class Llama(LanguageModel):
    family = "llama"
    config: LlamaConfig
    rope_cos: torch.Tensor  # buffers (register_buffer): typed here, as nn.Module's __getattr__ cannot say
    rope_sin: torch.Tensor

    def __init__(self, c: LlamaConfig):
        super().__init__()
        if c.n_embd % c.n_head or c.n_head % c.n_kv_head or c.head_dim % 2:
            raise ValueError(
                f"n_embd ({c.n_embd}) must split into n_head ({c.n_head}) heads of even size, "
                f"and n_head into groups of n_kv_head ({c.n_kv_head})"
            )
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.n_embd)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.lm_head = LMHead(c.n_embd, c.vocab_size, bias=False)
        cos, sin = rope_tables(c.head_dim, c.block_size, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's Llama 3 initialisation (see the module docstring); also remakes the RoPE tables."""
        c = self.config
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        for i, block in enumerate(self.layers):
            assert isinstance(block, Block), (
                "called from __init__, before lmyard.train.distributed.parallel wraps the blocks"
            )
            deep = 0.02 / math.sqrt(2 * (i + 1))
            a, m = block.self_attn, block.mlp
            for lin, std in (
                (a.qkv_proj, 0.02),
                (a.o_proj, deep),
                (m.gate_proj, 0.02),
                (m.up_proj, deep),
                (m.down_proj, deep),
            ):
                nn.init.trunc_normal_(lin.weight, std=std)
            block.input_layernorm.reset_parameters()
            block.post_attention_layernorm.reset_parameters()
        self.norm.reset_parameters()
        s = c.n_embd**-0.5
        nn.init.trunc_normal_(self.lm_head.weight, std=s, a=-3 * s, b=3 * s)
        cos, sin = rope_tables(c.head_dim, c.block_size, c.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); with targets, only the mean cross-entropy (the head and its loss in one op)."""
        T = idx.size(1)
        assert T <= self.config.block_size, f"sequence of {T} exceeds block_size {self.config.block_size}"
        x = self.residual(self.embed_tokens(idx))
        cos, sin = self.rope_cos[:T].to(x.dtype), self.rope_sin[:T].to(x.dtype)
        c = self.config
        if c.doc_bos is None and c.doc_eos is None:
            for block in self.layers:
                x = block(x, cos, sin)
        else:  # one mask per batch, shared by every block; positions run on across documents
            mask = attention.document_mask(idx, c.doc_bos, c.doc_eos)
            for block in self.layers:
                x = block(x, cos, sin, mask)
        return self.lm_head(self.norm(x), targets)
