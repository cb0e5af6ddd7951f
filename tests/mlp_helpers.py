"""The GELU MLP tests' shared parts: an MLP's two layers, its output and gradients, the plain ops."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _mlp(d=48, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


def _out_and_grads(fn, x, fc, proj):
    x = x.detach().clone().requires_grad_()
    for p in (*fc.parameters(), *proj.parameters()):
        p.grad = None
    y = fn(x)
    (y.float() * torch.linspace(-1, 1, y.size(-1), device=y.device)).sum().backward()
    return [y.detach().float(), x.grad, fc.weight.grad, fc.bias.grad, proj.weight.grad, proj.bias.grad]


def _plain(fc, proj):
    return lambda x: proj(F.gelu(fc(x), approximate="tanh"))


def _rel(a, b):
    return (torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double())).item()
