"""FSDP2 training on 2 CPU ranks (gloo) against a plain single-process loop on the same global batches; validation,
bf16 shards' float32 masters and the token table's resume under FSDP2 (on two GPUs: tests/unit/train/test_fsdp.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from fsdp_helpers import MICRO, WORLD, _batches, _load_sharded, _null, _train

from lmyard.config import ModelConfig
from lmyard.models.registry import build_model
from lmyard.recipes import load_recipe
from lmyard.train.distributed.parallel import (
    no_sync,
    parallelize,
)
from lmyard.train.distributed.sharded_embedding import in_row_shards
from lmyard.train.optim import AdamW


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
