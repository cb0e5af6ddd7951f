"""`model.attention=fa4`: FlashAttention-4's kernels behind PyTorch's scaled_dot_product_attention.

PyTorch (2.11 and later) can route SDPA's flash backend to a registered implementation (the flash-attention
registry of torch.nn.attention); its FA4 entry calls the forward and backward of the flash-attn-4 package
(`flash_attn.cute.interface`, kernels written in the CuTe DSL and compiled on first use). The families keep
calling scaled_dot_product_attention, compiled or not; lmyard.models.attention.use_kernel("fa4") activates the
entry once per process, and `attention.causal` allows only the flash backend.

Design notes: docs/models.md, `lmyard/models/ops/flash4.py`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

IMPL = "lmyard-FA4"  # the name registered with torch's flash-attention registry
INSTALL = "pip install 'lmyard[fa4]'"


def _interface():
    return importlib.import_module("flash_attn.cute.interface")


def _flash_attn_fwd(*args, **kwargs):
    """flash-attn-4's forward, as (out, lse) whatever else its release returns."""
    result = _interface()._flash_attn_fwd(*args, **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args, **kwargs):
    """flash-attn-4's backward: (dq, dk, dv)."""
    return _interface()._flash_attn_bwd(*args, **kwargs)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def missing(device: torch.device) -> str | None:
    """What this process lacks to run FlashAttention-4 on `device`, in words; None when nothing."""
    if device.type != "cuda":
        return "a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"a Hopper or Blackwell GPU (compute capability 9.x or 10.x; this one is {major}.{minor})"
    if not hasattr(torch.nn.attention, "register_flash_attention_impl") or not _has("torch.nn.attention._fa4"):
        return f"torch 2.11 or later (this is {torch.__version__})"
    if not _has("flash_attn.cute.interface"):
        return f"the flash-attn-4 package ({INSTALL})"
    return None


def activate() -> None:
    """Route SDPA's flash backend to FlashAttention-4 in this process; a second call does nothing."""
    from torch.nn import attention

    if attention.current_flash_attention_impl() == IMPL:
        return
    if IMPL not in attention.list_flash_attention_impls():
        from torch.nn.attention import _fa4  # torch's FA4 entry, given this module in place of flash-attn-4's

        register = functools.partial(_fa4.register_flash_attention_fa4, module_path=__name__)
        attention.register_flash_attention_impl(IMPL, register_fn=register)
    attention.activate_flash_attention_impl(IMPL)
