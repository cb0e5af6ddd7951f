"""model.attention=fa4: SDPA's flash backend through FlashAttention-4 (lmyard.models.ops.flash4)."""

from __future__ import annotations

import pytest
import torch

from lmyard.config import ModelConfig
from lmyard.errors import UserError
from lmyard.models.ops import flash4
from lmyard.models.registry import build_model
from lmyard.recipes import load_recipe
from lmyard.train.distributed import setup_distributed
from lmyard.train.distributed.parallelism import ComputeContext

CUDA = torch.device("cuda", 0)
FA4_RUNS = torch.cuda.is_available() and flash4.missing(CUDA) is None


def test_fa4_attention_without_a_gpu_stops_before_the_process_group_in_one_line():
    cfg = load_recipe("smoke", ["model.attention=fa4", "train.device=cpu"])
    with pytest.raises(UserError) as refused:
        setup_distributed(cfg)
    assert str(refused.value) == "model.attention=fa4 needs a CUDA GPU; otherwise set model.attention=auto"


def test_fa4_names_the_gpu_generation_and_the_package_it_lacks(monkeypatch):
    """The GPU is faked (a capability read), so that the checks after it run on any machine."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert flash4.missing(CUDA) == "a Hopper or Blackwell GPU (compute capability 9.x or 10.x; this one is 8.0)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    if flash4._has("flash_attn.cute.interface"):
        assert flash4.missing(CUDA) is None
    else:
        assert flash4.missing(CUDA) == "the flash-attn-4 package (pip install 'lmyard[fa4]')"


def _loss_and_grads(model, idx, attention: str, compiled: bool) -> tuple[torch.Tensor, dict, set[str]]:
    torch._dynamo.reset()  # a compiled graph keeps the SDPA kernel it was traced with
    run = torch.compile(model) if compiled else model
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with ComputeContext(True, attention):
            loss = run(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.cuda.synchronize()
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, kernels


@pytest.fixture
def fa4_restored():
    yield
    torch.nn.attention.restore_flash_attention_impl()  # the next test's flash backend is PyTorch's own again


@pytest.mark.skipif(not FA4_RUNS, reason="needs a Hopper or Blackwell GPU and the flash-attn-4 package")
@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_attention_runs_flash_attention_4_kernels_and_trains_as_cudnn_attention_does(compiled, fa4_restored):
    torch.manual_seed(0)
    config = ModelConfig(preset="llama-tiny", n_embd=256, n_head=2, n_kv_head=1, block_size=256)
    model = build_model(config, 257).to(CUDA)  # heads of 128, two query heads a key/value head
    idx = torch.randint(0, 257, (2, 257), device=CUDA)
    loss, grads, kernels = _loss_and_grads(model, idx, "cudnn", compiled)
    fa4_loss, fa4_grads, fa4_kernels = _loss_and_grads(model, idx, "fa4", compiled)
    assert any("flash_attncute" in k and "Forward" in k for k in fa4_kernels), sorted(fa4_kernels)
    assert any("flash_attncute" in k and "Backward" in k for k in fa4_kernels), sorted(fa4_kernels)
    assert not any("flash_attncute" in k for k in kernels)
    torch.testing.assert_close(fa4_loss, loss, rtol=2e-3, atol=2e-3)
    for name, grad in grads.items():
        cosine = torch.nn.functional.cosine_similarity(fa4_grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.999, (name, cosine.item())
