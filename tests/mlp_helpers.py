"""The GELU MLP tests' shared parts: an MLP's two layers, its output and gradients, the plain ops, and the test
both tiers run on their own `compiled` fixture (eager: tests/unit/models/test_mlp.py; compiled:
tests/integration/test_mlp_integration.py), imported by each."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmyard.models import mlp


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


def test_gelu_mlp_output_and_gradients_equal_the_plain_mlp(compiled):
    fc, proj = _mlp()
    x = torch.randn(3, 7, 48, dtype=torch.float64)
    fc, proj = fc.double(), proj.double()
    fused = (
        (lambda a: mlp.gelu_mlp(a, fc, proj)) if not compiled else torch.compile(lambda a: mlp.gelu_mlp(a, fc, proj))
    )
    got, want = _out_and_grads(fused, x, fc, proj), _out_and_grads(_plain(fc, proj), x, fc, proj)
    for g, w in zip(got, want):
        assert g.shape == w.shape and _rel(g, w) < 1e-12
