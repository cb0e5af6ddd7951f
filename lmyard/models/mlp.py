"""GPT-2's MLP, `proj(gelu_tanh(fc(x)))`, with the GELU in the matrix products' epilogues: `gelu_mlp`.

Compiled as plain ops, the MLP makes two elementwise passes over its (tokens, 4d) activations besides
the products: the GELU forward and its gradient. On CUDA under 16-bit autocast this op runs the two
products around them through cuBLASLt (lmyard.models.ops.cublaslt) instead:

- forward: one product writes gelu(x @ W1.T + b1) and, for backward, its input;
- backward: the product dy @ W2 is multiplied by gelu'(input) as it is written.

Design notes: docs/models.md, `lmyard/models/mlp.py`.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmyard.models.ops import cublaslt

# LMYARD_MLP_EPILOGUES=0 in the environment keeps the plain ops everywhere (to compare the two, as
# tests/benchmarks/bench_trainer.py --env does)
ENABLED = os.environ.get("LMYARD_MLP_EPILOGUES", "1") != "0"


@torch.library.custom_op("lmyard::gelu_mlp", mutates_args=())
def _gelu_mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, pre) with pre = x @ w1.T + b1, h = gelu_tanh(pre), y = h @ w2.T + b2, all 2-D in x's dtype."""
    pre = x.new_empty(x.size(0), w1.size(0))
    h = cublaslt.linear(x, w1, epilogue="gelu_aux_bias", bias=b1, aux=pre) if x.is_cuda else None
    if h is None:
        pre = torch.addmm(b1, x, w1.t())
        h = F.gelu(pre, approximate="tanh")
    return torch.addmm(b2, h, w2.t()), h, pre


@_gelu_mlp.register_fake
def _(x, w1, b1, w2, b2):
    return x.new_empty(x.size(0), w2.size(0)), x.new_empty(x.size(0), w1.size(0)), x.new_empty(x.size(0), w1.size(0))


@torch.library.custom_op("lmyard::gelu_mlp_dgelu", mutates_args=())
def _dgelu(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """(dy @ w2) * gelu_tanh'(pre)."""
    dpre = cublaslt.linear(dy, w2, epilogue="dgelu", aux=pre, w_t=True) if dy.is_cuda else None
    if dpre is None:
        dpre = torch.ops.aten.gelu_backward(dy @ w2, pre, approximate="tanh")
    return dpre


@_dgelu.register_fake
def _(dy, w2, pre):
    return pre.new_empty(pre.shape)


def _setup(ctx, inputs, output) -> None:
    x, w1, _, w2, _ = inputs
    _, h, pre = output
    ctx.save_for_backward(x, w1, w2, h, pre)


def _backward(ctx, dy, _dh, _dpre):
    x, w1, w2, h, pre = ctx.saved_tensors
    dy = dy.contiguous()
    dpre = _dgelu(dy, w2, pre)  # the bias gradients are sums inductor makes (cuBLASLt's BGRAD epilogue is slower)
    return dpre @ w1, dpre.t() @ x, dpre.sum(0), dy.t() @ h, dy.sum(0)


_gelu_mlp.register_autograd(_backward, setup_context=_setup)


def fused(x: torch.Tensor, fc: nn.Linear, proj: nn.Linear) -> bool:
    """Whether `gelu_mlp` is the faster path for this call: training on CUDA under fp16/bf16 autocast, with
    biases (GPT-2's), through plain nn.Linear modules (not torchao's float8 ones, train.float8). Inference
    and fp32 keep the plain ops."""
    return (
        ENABLED
        and type(fc) is nn.Linear
        and type(proj) is nn.Linear
        and x.is_cuda
        and torch.is_grad_enabled()
        and torch.is_autocast_enabled("cuda")
        and torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16)
        and fc.bias is not None
        and proj.bias is not None
    )


def gelu_mlp(x: torch.Tensor, fc: nn.Linear, proj: nn.Linear) -> torch.Tensor:
    """`proj(gelu_tanh(fc(x)))` for x (..., d), in the autocast dtype where autocast is on (as `F.linear`)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    assert fc.bias is not None and proj.bias is not None, "gelu_mlp needs both linears' biases"
    x2 = x.reshape(-1, x.size(-1)).to(dtype)
    y, _, _ = _gelu_mlp(x2, fc.weight.to(dtype), fc.bias.to(dtype), proj.weight.to(dtype), proj.bias.to(dtype))
    return y.view(*x.shape[:-1], y.size(-1))
