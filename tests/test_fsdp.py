"""FSDP2 training on 2 CPU ranks (gloo) against a plain single-process loop on the same global batches; on two
GPUs, the copy-engine all-gather against NCCL's kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

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
from lmyard.train.distributed.sharded_embedding import in_row_shards
from lmyard.train.optim import AdamW, clipped_update

STEPS, ACCUM, MICRO, WORLD = 4, 2, 2, 2


def _batches(doc_len: int | None = None):
    """Random byte-tokenizer ids; with doc_len, an <|endoftext|> (256) once per doc_len tokens on average."""
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, 257, (MICRO * WORLD, 65), generator=g) for _ in range(ACCUM)] for _ in range(STEPS)]
    if doc_len:
        for rows in (r for step in batches for r in step):
            rows[torch.rand(rows.shape, generator=g) < 1 / doc_len] = 256
    return batches


def _train(model, params, batches, rank, world, sync, max_norm=0.5, opt=None):
    """AdamW steps over `batches` (each: ACCUM micro-batches of the global batch); this rank takes its rows."""
    opt = opt or AdamW(model.param_groups(0.1) if hasattr(model, "param_groups") else params, lr=3e-3)
    losses = []
    for micro_batches in batches:
        total = 0.0
        for i, rows in enumerate(micro_batches):
            mine = rows.chunk(world)[rank]
            with sync(i == ACCUM - 1):
                loss = model(mine[:, :-1], mine[:, 1:])
                (loss / ACCUM).backward()
            total += loss.detach() / ACCUM
        norm = clipped_update(params, opt, max_norm)
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)
        losses.append((float(total) / world, float(norm)))
    return losses


def _worker(rank: int, port: int, runs: list[tuple[str, str, bool, str]]) -> None:
    """runs: (preset, train.activation_checkpointing, model.doc_mask, train.fsdp_embedding); `selective:1` is
    selective on the first block only (train.activation_checkpointing_blocks=1)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for preset, ac, doc_mask, embedding in runs:
            mode, _, blocks = ac.partition(":")
            batches = _batches(doc_len=16 if doc_mask else None)
            model_cfg, separators = ModelConfig(preset=preset, doc_mask=doc_mask), (256, None)
            torch.manual_seed(0)
            ref = build_model(model_cfg, 257, separators)
            init = {k: v.clone() for k, v in ref.state_dict().items()}
            ref_losses = _train(ref, list(ref.parameters()), batches, 0, 1, lambda last: _null())
            torch.manual_seed(123)  # a different init, then the reference's weights: sharding must keep them
            model = build_model(model_cfg, 257, separators)
            model.load_state_dict(init)
            cfg = load_recipe(
                "smoke",
                [
                    f"model.preset={preset}",
                    "train.parallel=fsdp",
                    "train.device=cpu",
                    f"train.activation_checkpointing={mode}",
                    f"model.doc_mask={doc_mask}",
                    *([f"train.activation_checkpointing_blocks={blocks}"] if blocks else []),
                    f"train.fsdp_embedding={embedding}",
                ],
            )
            model = parallelize(model, cfg, WORLD, torch.device("cpu"))
            assert in_row_shards(model) == (embedding == "sharded" and preset.startswith("llama")), (preset, embedding)
            params = list(model.parameters())
            assert all(type(p).__name__ == "DTensor" for p in params)
            losses = _train(
                model, params, batches, rank, WORLD, lambda last, model=model: _null() if last else no_sync(model)
            )
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            if rank == 0:
                for (a, na), (b, nb) in zip(losses, ref_losses):
                    assert abs(a - b) < 1e-4 and abs(na - nb) < 1e-4, (preset, ac, losses, ref_losses)
                for k, v in ref.state_dict().items():
                    assert torch.allclose(full[k], v, atol=2e-5), (preset, ac, k, (full[k] - v).abs().max())
                assert not torch.allclose(full["lm_head.weight"], init["lm_head.weight"])  # it did train
    finally:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.integration
def test_fsdp_on_two_ranks_trains_as_one_process_on_the_whole_batch_with_and_without_checkpointing():
    """Same init, same global batches, gradient accumulation (no_sync on the first micro-step), clipping:
    the 2-rank FSDP2 run's losses, grad norms and weights match the plain loop's: Llama with activation
    checkpointing off and selective, GPT-2 (tied embeddings in the root unit) with full and with pointwise (its
    MLP on plain ops, every matmul's output kept), and Llama with document
    masking (model.doc_mask: the mask passed through the checkpointed, sharded blocks) under selective, and
    Llama with selective checkpointing on its first block only; Llama's table looked up in its row shards
    (train.fsdp_embedding=sharded, 257 rows split 129 + 128), without and with checkpointing."""
    runs = [("llama-tiny", "none", False, "gathered"), ("llama-tiny", "selective", False, "auto")]
    runs += [("tiny", "full", False, "sharded"), ("tiny", "pointwise", False, "auto")]  # GPT-2: a tied table
    runs += [("llama-tiny", "selective", True, "gathered"), ("llama-tiny", "selective:1", False, "gathered")]
    runs += [("llama-tiny", "none", False, "sharded"), ("llama-tiny", "full", False, "sharded")]
    mp.spawn(_worker, args=(free_port(), runs), nprocs=WORLD, join=True)


def test_fsdp_reduce_dtype_sets_the_gradient_reduction_on_cuda_and_stays_float32_on_cpu():
    from lmyard.train.distributed.parallel import mixed_precision

    default, cfg = load_recipe("smoke"), load_recipe("smoke", ["train.fsdp_reduce_dtype=bfloat16"])
    assert default.train.fsdp_reduce_dtype == "float32"
    cuda = torch.device("cuda", 0)  # a policy only: no GPU is touched
    assert mixed_precision(cuda, default.train.fsdp_reduce_dtype).reduce_dtype == torch.float32
    bf16 = mixed_precision(cuda, cfg.train.fsdp_reduce_dtype)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert mixed_precision(torch.device("cpu"), "bfloat16").reduce_dtype == torch.float32  # gloo sums in fp32


def _validate_worker(rank: int, port: int) -> None:
    from lmyard.evaluate.validation import val_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        sets = [
            "model.preset=llama-tiny",
            "train.parallel=fsdp",
            "train.device=cpu",
            "train.activation_checkpointing=none",
        ]
        # 5 sequences, 4 a call: rank 0 scores 3 in its one call, rank 1 scores 2
        val = torch.randint(0, 257, (5, 65), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(0)
        whole = val_loss(build_model(ModelConfig(preset="llama-tiny"), 257, (256, None)), val, 4, "cpu")
        for embedding in ("gathered", "sharded"):
            cfg = load_recipe(
                "smoke", [*sets, "train.fsdp_reshard_after_forward=false", f"train.fsdp_embedding={embedding}"]
            )
            torch.manual_seed(0)
            model = parallelize(build_model(cfg.model, 257, (256, None)), cfg, WORLD, torch.device("cpu"))
            assert in_row_shards(model) == (embedding == "sharded")
            loss = val_loss(model, val, 4, "cpu", rank=rank, world=WORLD)
            assert abs(loss - whole) < 1e-5, (embedding, loss, whole)
            kinds = {type(v).__name__ for v in [*model.parameters(), *model.state_dict().values()]}
            assert kinds == {"DTensor"}, kinds  # sharded again: a checkpoint right after saves shards, not gathers
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_validation_under_fsdp_that_keeps_blocks_gathered_leaves_the_parameters_sharded():
    """With train.fsdp_reshard_after_forward=false a forward leaves each block gathered for its backward; the
    val loss runs forwards with no backward, so it reshards them itself, and a checkpoint saved after it holds
    the shards. The ranks' last calls score different numbers of sequences (3 and 2), the token table gathered
    or in its row shards, and the val loss is the one process's."""
    mp.spawn(_validate_worker, args=(free_port(),), nprocs=WORLD, join=True)


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


def _bf16_shards_worker(rank: int, port: int) -> None:
    from lmyard.train.distributed.parallel import apply_fsdp, fsdp_mesh
    from lmyard.train.optim import MASTER_ATTR

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # GPT-2's tied table and head: one parameter, rounded once; Llama's table also in row shards
        for preset, embedding in (("llama-tiny", "gathered"), ("tiny", "gathered"), ("llama-tiny", "sharded")):
            torch.manual_seed(0)
            model = build_model(ModelConfig(preset=preset), 257, (256, None))
            init = {k: v.clone() for k, v in model.state_dict().items()}
            cpu = torch.device("cpu")
            apply_fsdp(model, fsdp_mesh(WORLD, cpu), cpu, param_dtype="bfloat16", embedding=embedding)
            weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
            for name, p in model.named_parameters():
                master = getattr(p, MASTER_ATTR)
                assert p.dtype == torch.bfloat16 and master.dtype == torch.float32 and master.placements == p.placements
                assert torch.equal(master.full_tensor(), init[name]), name  # this rank's part is FSDP2's shard
                assert torch.equal(weights[name], init[name].to(torch.bfloat16)), name
            assert all(not b.is_floating_point() or b.dtype == torch.float32 for b in model.buffers())  # RoPE's tables
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_bf16_shards_keep_each_ranks_float32_part_of_the_initial_weights_as_master():
    """train.fsdp_param_dtype=bfloat16: FSDP2 shards bf16 weights (the float32 ones rounded), and each sharded
    parameter carries, for the optimizer, a float32 DTensor of the same sharding whose parts are exactly the
    float32 initial weights: uneven splits (257-row embeddings over 2 ranks), GPT-2's tied parameter, Llama's
    table in row shards (train.fsdp_embedding=sharded)."""
    mp.spawn(_bf16_shards_worker, args=(free_port(),), nprocs=WORLD, join=True)


def _load_sharded(model, opt, folder: str) -> None:
    """As the trainer resumes a sharded checkpoint (lmyard.checkpoint.dcp_load.load_sharded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from lmyard.checkpoint.dcp import state_dict

    target = state_dict(model, opt)
    dcp.load(target, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])


def _embedding_resume_worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    from lmyard.checkpoint.dcp import state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)

    def trained(embedding: str, batches, folder_in: str | None = None):
        sets = [
            "model.preset=llama-tiny",
            "train.parallel=fsdp",
            "train.device=cpu",
            "train.activation_checkpointing=none",
        ]
        # auto: 2 ranks x 2 rows x 64 tokens (256) <= 257 rows, so the table is looked up in its row shards
        cfg = load_recipe("smoke", [*sets, f"train.micro_batch={MICRO}", f"train.fsdp_embedding={embedding}"])
        torch.manual_seed(0)
        model = parallelize(build_model(cfg.model, 257, (256, None)), cfg, WORLD, torch.device("cpu"))
        opt = AdamW(model.param_groups(0.1), lr=3e-3)
        if folder_in is not None:
            _load_sharded(model, opt, folder_in)
        sync = lambda last, m=model: _null() if last else no_sync(m)
        return model, opt, _train(model, list(model.parameters()), batches, rank, WORLD, sync, float("inf"), opt)

    try:
        batches = _batches()
        _, _, straight = trained("gathered", batches)
        for saved, resumed in (("gathered", "auto"), ("sharded", "gathered")):
            model, opt, first = trained(saved, batches[:2])
            dcp.save(state_dict(model, opt), checkpoint_id=f"{folder}/{saved}")
            model, opt, then = trained(resumed, batches[2:], f"{folder}/{saved}")
            for (a, na), (b, nb) in zip(first + then, straight):
                assert abs(a - b) < 1e-5 and abs(na - nb) < 1e-5, (saved, first + then, straight)
            assert in_row_shards(model) == (resumed == "auto")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_a_checkpoint_resumes_with_the_token_table_gathered_or_in_row_shards_either_way(tmp_path):
    """The row-sharded table (train.fsdp_embedding=sharded; auto's choice here, where the ranks' 256 tokens of a
    micro-step are no more than the 257 rows) is the same DTensor parameter FSDP2 shards: 2 steps under one
    setting, a sharded checkpoint, 2 steps under the other resume the 4 straight steps' losses and gradient
    norms, both ways round."""
    mp.spawn(_embedding_resume_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)


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
