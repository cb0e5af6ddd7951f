"""lmyard.train.optim: AdamW with the clip's scale inside its step, against clip_grad_norm_ + torch's AdamW (its
Triton kernels in Triton's interpreter: tests/integration/test_optim_integration.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from lmyard.train.optim import AdamW, clipped_update


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0},
    ]


def _backward(model: torch.nn.Module, step: int, device: str = "cpu") -> None:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step)).to(device)
    (model(x).pow(2).sum() * 10).backward()


def _side_by_side(ours, opt_a, theirs, opt_b, steps: int, max_norm: float, device: str = "cpu") -> list[tuple]:
    """`steps` steps of each model on the same batches: ours by clipped_update, theirs by clip_grad_norm_
    and its optimizer's step; both gradient norms of each step."""
    norms = []
    for step in range(steps):
        _backward(ours, step, device)
        _backward(theirs, step, device)
        norm_a = clipped_update(list(ours.parameters()), opt_a, max_norm)
        norms.append((norm_a, torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)))
        opt_b.step()
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("max_norm", [0.5, float("inf")], ids=["clipping", "no-clip"])
def test_clipped_update_equals_clip_grad_norm_then_adamw_step(max_norm):
    ours, theirs = _model(), _model()
    opt_a = AdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95))
    opt_b = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.9, 0.95))
    for norm_a, norm_b in _side_by_side(ours, opt_a, theirs, opt_b, 3, max_norm):
        assert torch.equal(norm_a, norm_b)
        assert norm_a > 0.5  # the clip scaled every step where it could
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_before_update_runs_after_the_norm_and_before_the_weights_change():
    model = _model()
    opt = AdamW(_groups(model), lr=1e-2)
    _backward(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    clipped_update(list(model.parameters()), opt, 1.0, lambda: seen.append(all(
        torch.equal(p, b) for p, b in zip(model.parameters(), before))))  # fmt: skip
    assert seen == [True]
    assert not torch.equal(next(model.parameters()), before[0])


def test_state_dict_moves_between_lmyard_adamw_and_torch_adamw_both_ways():
    """A checkpoint's optimizer state is torch's AdamW's: one resumes from the other's exactly."""
    ours, theirs = _model(), _model()
    opt_a = AdamW(_groups(ours), lr=1e-2)
    _backward(ours, 0)
    clipped_update(list(ours.parameters()), opt_a, 1.0)
    theirs.load_state_dict(ours.state_dict())
    opt_b = torch.optim.AdamW(_groups(theirs), lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # a copy, as a checkpoint holds: not shared moments
    for model, opt in ((ours, opt_a), (theirs, opt_b)):
        opt.zero_grad(set_to_none=True)
        _backward(model, 1)
        clipped_update(list(model.parameters()), opt, 1.0)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    back = AdamW(_groups(ours), lr=1e-2)
    back.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert float(back.state[next(ours.parameters())]["step"]) == 2.0


def test_bf16_weights_step_their_float32_masters_through_torchs_step_where_the_kernel_cannot_run():
    """On the CPU a bf16 parameter's float32 master moves as a float32 parameter holding its values does under
    torch's AdamW, given the same bf16 gradients; the parameter is its master rounded to bf16."""
    from lmyard.train.optim import keep_master

    ours, theirs = _model(), _model()
    for p in ours.parameters():
        keep_master(p, p.detach().clone())
        p.data = p.data.to(torch.bfloat16)
    opt_a, opt_b = AdamW(_groups(ours), lr=1e-2), torch.optim.AdamW(_groups(theirs), lr=1e-2)
    for step in range(3):
        _backward(theirs, step)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            b.grad = b.grad.to(torch.bfloat16).float()  # the bf16 gradients both sides are given
            a.grad = b.grad.to(torch.bfloat16)
        norm = clipped_update(list(ours.parameters()), opt_a, 0.5)
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5))
        opt_b.step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        state = opt_a.state[a]
        assert a.dtype == torch.bfloat16 and state["master"].dtype == state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["master"], b.detach())
        assert torch.equal(a.detach(), b.detach().to(torch.bfloat16))
    assert len(opt_a.state) == len(list(ours.parameters()))  # the masters' own entries are gone after the step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_step_on_cuda_matches_clip_then_torch_adamw():
    # torch's foreach AdamW: its bias corrections in float64 as the kernel's (its fused one rounds them to float32)
    ours, theirs = _model().cuda(), _model().cuda()
    opt_a = AdamW(_groups(ours), lr=1e-2, fused=True)
    opt_b = torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=True)
    _side_by_side(ours, opt_a, theirs, opt_b, 5, 0.5, "cuda")
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert ((a - b).norm() / b.norm()).item() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_step_updates_fsdp_shards_in_place_on_cuda():
    """Under FSDP2 the kernel writes each DTensor's local shard: the model moves as a plain one does."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lmyard.train.distributed.parallel import fsdp_mesh

    mesh = fsdp_mesh(1, torch.device("cuda", torch.cuda.current_device()))
    try:
        sharded, plain = _model().cuda(), _model().cuda()
        fully_shard(sharded, mesh=mesh)
        opt_a = AdamW(_groups(sharded), lr=1e-2, fused=True)
        opt_b = torch.optim.AdamW(_groups(plain), lr=1e-2, foreach=True)
        for norm_a, norm_b in _side_by_side(sharded, opt_a, plain, opt_b, 3, 0.5, "cuda"):
            assert abs(norm_a.item() - norm_b.item()) <= 1e-6 * norm_b.item()  # the kernel's norm of the shards
        for a, b in zip(sharded.parameters(), plain.parameters()):
            assert ((a.full_tensor() - b).norm() / b.norm()).item() < 1e-6
    finally:
        dist.destroy_process_group()
