"""FSDP2's settings (the gradient reduction's dtype, the copy-engine all-gather, side-stream copies) and, on two
GPUs, the copy-engine all-gather against NCCL's kernels, side-stream copies and bf16 shards against float32 ones
(2 CPU ranks against a plain single-process loop: tests/integration/test_fsdp_integration.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from fsdp_helpers import WORLD, _batches, _load_sharded, _null, _train

from lmyard.config import ModelConfig
from lmyard.errors import UserError
from lmyard.models.registry import build_model
from lmyard.recipes import load_recipe
from lmyard.train.distributed.parallel import (
    all_gather_mode,
    init_process_group,
    no_sync,
    parallelize,
    process_group_options,
)
from lmyard.train.optim import AdamW


def test_fsdp_reduce_dtype_sets_the_gradient_reduction_on_cuda_and_stays_float32_on_cpu():
    from lmyard.train.distributed.parallel import mixed_precision

    default, cfg = load_recipe("smoke"), load_recipe("smoke", ["train.fsdp_reduce_dtype=bfloat16"])
    assert default.train.fsdp_reduce_dtype == "float32"
    cuda = torch.device("cuda", 0)  # a policy only: no GPU is touched
    assert mixed_precision(cuda, default.train.fsdp_reduce_dtype).reduce_dtype == torch.float32
    bf16 = mixed_precision(cuda, cfg.train.fsdp_reduce_dtype)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert mixed_precision(torch.device("cpu"), "bfloat16").reduce_dtype == torch.float32  # gloo sums in fp32


def test_copy_engine_all_gather_is_chosen_only_on_one_cuda_host_and_refused_in_one_line_elsewhere():
    """train.fsdp_all_gather: auto takes the copy engines only where they can run (CUDA, two or more ranks, all
    on one host, NCCL 2.28+); asked for elsewhere, one line names what is missing and how to go on."""
    fsdp = load_recipe("smoke", ["train.parallel=fsdp"]).train
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # device objects only: no GPU is touched
    assert fsdp.fsdp_all_gather == "auto"
    for device, world, local in [(cpu, 2, 2), (cuda, 1, 1), (cuda, 8, 4)]:
        assert all_gather_mode(fsdp, device, world, local) == "nccl"
    ddp = load_recipe("smoke", ["train.fsdp_all_gather=copy_engine"]).train  # ddp gathers no parameters
    assert all_gather_mode(ddp, cpu, 2, 2) == "nccl"
    asked = fsdp.model_copy(update={"fsdp_all_gather": "copy_engine"})
    for device, world, local, missing in [
        (cpu, 2, 2, "needs a CUDA device, and this run is on the CPU"),
        (cuda, 1, 1, "needs two or more ranks, and this run has one"),
        (cuda, 8, 4, "needs every rank on one host, and this run has 8 ranks with 4 on this host"),
    ]:
        with pytest.raises(UserError) as e:
            all_gather_mode(asked, device, world, local)
        assert missing in str(e.value) and str(e.value).endswith("set train.fsdp_all_gather=auto or nccl")
    assert process_group_options("nccl") is None


def _cuda_runs(rank: int, port: int, modes: dict[str, list[str]]) -> dict[str, tuple]:
    """Train llama-tiny from one init on the same batches once per entry of `modes` (its config overrides)
    on two GPUs (the process group as copy_engine makes it): (losses, full weights, gathered into symmetric
    memory) per mode. Math SDPA, so that runs can be compared exactly."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    options = process_group_options("copy_engine")
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=device, pg_options=options)
    try:
        runs = {}
        for mode, overrides in modes.items():
            sets = ["model.preset=llama-tiny", "train.parallel=fsdp", "train.device=cuda", "train.compile=false"]
            cfg = load_recipe("smoke", [*sets, "train.activation_checkpointing=none", *overrides])
            torch.manual_seed(0)
            with torch.device(device):
                model = parallelize(build_model(cfg.model, 257, (256, None)), cfg, WORLD, device)
            batches = [[rows.to(device) for rows in step] for step in _batches()]
            with sdpa_kernel([SDPBackend.MATH]):
                losses = _train(
                    model,
                    list(model.parameters()),
                    batches,
                    rank,
                    WORLD,
                    lambda last, m=model: _null() if last else no_sync(m),
                )
            weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
            runs[mode] = (losses, weights, device in symm_mem._symm_mem_pools)
        return runs
    finally:
        dist.destroy_process_group()


def _copy_engine_worker(rank: int, port: int) -> None:
    modes = {m: [f"train.fsdp_all_gather={m}", "train.fsdp_copies=compute"] for m in ("nccl", "copy_engine")}
    runs = _cuda_runs(rank, port, modes)
    (losses, weights, pooled), (ce_losses, ce_weights, ce_pooled) = runs["nccl"], runs["copy_engine"]
    assert not pooled and ce_pooled  # only the copy-engine run gathered into symmetric memory
    assert ce_losses == losses, (ce_losses, losses)
    assert all(torch.equal(ce_weights[k], w) for k, w in weights.items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copy_engine_all_gather_trains_exactly_as_nccl_kernels_on_two_gpus():
    """The same init and batches under train.fsdp_all_gather=nccl and copy_engine (NCCL's zero-CTA policy,
    symmetric buffers): equal losses and equal weights after 4 steps."""
    mp.spawn(_copy_engine_worker, args=(free_port(),), nprocs=WORLD, join=True)


def test_fsdp_copies_settle_to_side_streams_only_for_big_blocks_where_they_can_run():
    """train.fsdp_copies=auto takes the side streams on CUDA with two ranks or more for blocks of 150M
    parameters or more (Llama-3 8B's), the compute stream for smaller blocks, elsewhere and under ddp;
    `side` asked for on the CPU or one rank is one line naming what is missing."""
    from lmyard.train.distributed.parallel import block_params, copies_mode

    with torch.device("meta"):
        big, small = (
            block_params(build_model(ModelConfig(preset=p), 128256, (0, None))) for p in ("llama-8b", "llama-1b")
        )
    fsdp = load_recipe("smoke", ["train.parallel=fsdp"]).train
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # device objects only: no GPU is touched
    assert fsdp.fsdp_copies == "auto"
    assert copies_mode(fsdp, cuda, 4, big) == "side"
    assert (
        copies_mode(fsdp, cuda, 4, small)
        == copies_mode(fsdp, cpu, 2, big)
        == copies_mode(fsdp, cuda, 1, big)
        == "compute"
    )
    asked = fsdp.model_copy(update={"fsdp_copies": "side"})
    assert copies_mode(asked, cuda, 4, small) == "side"
    assert copies_mode(load_recipe("smoke", ["train.fsdp_copies=side"]).train, cuda, 4, big) == "compute"  # ddp
    for device, world, missing in [(cpu, 2, "a CUDA device"), (cuda, 1, "two or more ranks")]:
        with pytest.raises(UserError) as e:
            copies_mode(asked, device, world, big)
        assert str(e.value) == f"train.fsdp_copies=side needs {missing}; set train.fsdp_copies=auto or compute"
    with pytest.raises(UserError, match="train.fsdp_copies=side needs a CUDA device"):  # as the trainer starts
        init_process_group(asked, cpu, 1, 1)


def _side_copies_worker(rank: int, port: int) -> None:
    from lmyard.train.distributed import fsdp_copies

    settings = {  # each block gathered again for backward, fp32 reduction; or kept from forward, all bf16
        "resharded": ["train.fsdp_reshard_after_forward=true"],
        "kept": ["train.fsdp_reshard_after_forward=false", "train.fsdp_reduce_dtype=bfloat16"]
        + ["train.fsdp_param_dtype=bfloat16"],
    }
    modes = {
        f"{where}-{k}": [f"train.fsdp_copies={where}", *v] for where in ("compute", "side") for k, v in settings.items()
    }
    runs = _cuda_runs(rank, port, modes)
    for k in settings:
        (losses, weights, _), (side_losses, side_weights, _) = runs[f"compute-{k}"], runs[f"side-{k}"]
        assert side_losses == losses, (k, side_losses, losses)
        assert all(torch.equal(side_weights[n], w) for n, w in weights.items()), k
    assert not fsdp_copies._SPLIT_DONE  # every split queued on the all-gather stream was waited for
    assert not fsdp_copies._HELD_GRADS  # and every gradient the cats read was let go at the end of backward
    assert fsdp_copies._ORIGINAL  # FSDP2's internals were rebound


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp_copies_on_side_streams_train_exactly_as_on_the_compute_stream_on_two_gpus():
    """train.fsdp_copies=side against compute, each block resharded after forward (fp32 reduction: FSDP2's own
    cat) or kept gathered (bf16 shards and reduction: the cats by memcpy too; the head's 257 rows, uneven over
    two ranks, by FSDP2's cat), with gradient accumulation: equal losses and bit-equal weights after 4 steps."""
    mp.spawn(_side_copies_worker, args=(free_port(),), nprocs=WORLD, join=True)


def _bf16_params_worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lmyard.checkpoint.dcp import state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=device)

    def trained(dtype: str, batches, opt_state=None):
        sets = ["model.preset=llama-tiny", "train.parallel=fsdp", "train.device=cuda", "train.compile=false"]
        sets += ["train.activation_checkpointing=none", "train.fsdp_all_gather=nccl"]
        cfg = load_recipe("smoke", [*sets, "train.fsdp_reduce_dtype=bfloat16", f"train.fsdp_param_dtype={dtype}"])
        torch.manual_seed(0)
        with torch.device(device):
            model = parallelize(build_model(cfg.model, 257, (256, None)), cfg, WORLD, device)
        opt = AdamW(model.param_groups(0.1), lr=3e-3)
        if opt_state is not None:
            _load_sharded(model, opt, opt_state)
        sync = lambda last, m=model: _null() if last else no_sync(m)
        with sdpa_kernel([SDPBackend.MATH]):  # deterministic, so the runs can be compared exactly
            losses = _train(model, list(model.parameters()), batches, rank, WORLD, sync, float("inf"), opt)
        return model, opt, losses

    try:
        batches = [[rows.to(device) for rows in step] for step in _batches()]
        f32, _, f32_losses = trained("float32", batches)
        bf16, opt, bf16_losses = trained("bfloat16", batches[:2])
        dcp.save(state_dict(bf16, opt), checkpoint_id=folder)
        resumed, opt, resumed_losses = trained("bfloat16", batches[2:], opt_state=folder)
        assert [loss for loss, _ in bf16_losses + resumed_losses] == [loss for loss, _ in f32_losses]
        for (name, p), (_, q) in zip(resumed.named_parameters(), f32.named_parameters()):
            assert p.dtype == torch.bfloat16 and opt.state[p]["master"].dtype == torch.float32
            master, weight = opt.state[p]["master"].full_tensor(), q.full_tensor()
            assert torch.equal(master, weight), (name, (master - weight).abs().max())
            assert torch.equal(p.full_tensor(), weight.to(torch.bfloat16)), name
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_bf16_shards_train_and_resume_exactly_as_float32_shards_on_two_gpus(tmp_path):
    """Gradients reduced in bf16 either way: 4 steps with float32 shards against 2 steps with bf16 shards, a
    sharded checkpoint, and 2 more steps resumed from it. Equal losses; the masters equal the float32
    weights bit for bit and the bf16 weights are them rounded."""
    mp.spawn(_bf16_params_worker, args=(free_port(), str(tmp_path / "ckpt")), nprocs=WORLD, join=True)
