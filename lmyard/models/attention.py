"""Document masking (`model.doc_mask`): block-causal attention over the documents packed in a sequence.

Design notes: docs/models.md, `lmyard/models/attention.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lmyard.models.ops import flash4

Mask = BlockMask | torch.Tensor  # a BlockMask (CUDA) or a dense boolean mask (CPU)

KERNELS = {  # model.attention: the SDPA kernel `causal` allows (none: PyTorch's choice)
    "auto": (),
    "fa4": (SDPBackend.FLASH_ATTENTION,),  # with SDPA's flash backend routed to FlashAttention-4 (flash4)
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "cudnn": (SDPBackend.CUDNN_ATTENTION,),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION,),
    "math": (SDPBackend.MATH,),
}
_choice = "auto"  # this process's model.attention, read (and guarded on) where a graph is traced


def use_kernel(choice: str) -> str:
    """Make `model.attention=choice` this process's causal attention kernel (fa4: FlashAttention-4 activated in
    SDPA's flash backend first, for the rest of the process); returns the choice it replaces."""
    global _choice
    if choice == "fa4":
        flash4.activate()
    before, _choice = _choice, choice
    return before


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, enable_gqa: bool = False):
    """Causal attention of (B, H, T, Dh) queries over (B, H_kv, T, Dh) keys and values, by `use_kernel`'s kernel."""
    kernels = KERNELS[_choice]
    if not kernels:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)
    with sdpa_kernel(list(kernels)):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)


def document_ids(idx: torch.Tensor, bos: int | None, eos: int | None) -> torch.Tensor:
    """(B, T) document index of every token (see the module docstring); only equality between them matters."""
    docs = torch.zeros_like(idx)
    if bos is not None:  # a document begins at its bos: counted from the bos on
        docs = docs + (idx == bos).cumsum(1)
    if eos is not None:  # a document ends at its eos: counted from the token after it
        ends = (idx == eos).long()
        docs = docs + ends.cumsum(1) - ends
    return docs


_COMPILED: dict = {}


def _compiled(fn):
    """`fn` itself while dynamo traces a compiled model or block (inductor compiles it with them), else
    torch.compile(fn), made once per process on first use (compiling at import would cost every import)."""
    if torch.compiler.is_compiling():
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def block_mask(docs: torch.Tensor) -> BlockMask:
    """The FlexAttention BlockMask of `document_ids` (compiled on CUDA; eager elsewhere, for tests)."""
    B, T = docs.shape

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    make = _compiled(create_block_mask) if docs.device.type == "cuda" else create_block_mask
    return make(same_document_causal, B, None, T, T, device=docs.device)


def dense_mask(docs: torch.Tensor) -> torch.Tensor:
    """The (B, 1, T, T) boolean mask of `document_ids`: True where a query may attend to a key."""
    T = docs.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def document_mask(idx: torch.Tensor, bos: int | None, eos: int | None) -> Mask:
    """The mask every block of one forward shares: a BlockMask on CUDA, a dense one elsewhere."""
    docs = document_ids(idx, bos, eos)
    return block_mask(docs) if idx.device.type == "cuda" else dense_mask(docs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of (B, H, T, Dh) queries over (B, H_kv, T, Dh) keys and values under a document mask."""
    if isinstance(mask, BlockMask):
        flex = _compiled(flex_attention) if q.device.type == "cuda" else flex_attention
        return flex(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
