"""The language-model head and its loss in one op: `linear_cross_entropy(x, weight, targets)`.

Equal to `F.cross_entropy(x @ weight.T, targets)`, but the gradient of the logits is computed in the forward
pass, in the logits' own buffer (one Triton kernel on CUDA; plain torch elsewhere).

Design notes: docs/models.md, `lmyard/models/losses.py`.
"""

from __future__ import annotations

import torch

from lmyard.models.ops.cross_entropy import loss_and_grad


@torch.library.custom_op("lmyard::linear_cross_entropy", mutates_args=())
def _linear_ce(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d logits) of logits = x @ weight.T computed in `dtype`; the gradient is empty
    without `need_grad`."""
    logits = x.to(dtype) @ weight.to(dtype).t()
    losses = loss_and_grad(logits, targets, need_grad)
    return losses.mean(), logits if need_grad else logits.new_empty(0)


@_linear_ce.register_fake
def _(x, weight, targets, dtype, need_grad):
    grad = x.new_empty(x.size(0), weight.size(0), dtype=dtype) if need_grad else x.new_empty(0, dtype=dtype)
    return x.new_empty((), dtype=torch.float32), grad


def _setup(ctx, inputs, output) -> None:
    x, weight, _, dtype, _ = inputs
    ctx.dtype = dtype
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_loss, _grad_of_grad):
    x, weight, grad_logits = ctx.saved_tensors
    if grad_logits.numel() == 0:
        raise RuntimeError("linear_cross_entropy ran without need_grad, so it has no gradient to give back")
    # the logits' gradient is for a loss of weight 1: scale the (small) products, in their inputs' precision
    grad_x = (grad_logits @ weight.to(ctx.dtype)).to(x.dtype) * grad_loss
    grad_w = (grad_logits.t() @ x.to(ctx.dtype)).to(weight.dtype) * grad_loss
    return grad_x, grad_w, None, None, None


_linear_ce.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `x @ weight.T` (shape (..., V)) against `targets` (...); x is (..., d).
    Under autocast the product runs in the autocast dtype, as `F.linear` would."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss, _ = _linear_ce(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1).contiguous(), dtype, need_grad)
    return loss
