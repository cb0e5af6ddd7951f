"""FSDP2's tests' shared parts: the global batches, the plain loop that trains on them, and the sharded
checkpoint's load as the trainer resumes one."""

from __future__ import annotations

import torch
import torch.distributed as dist

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


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _load_sharded(model, opt, folder: str) -> None:
    """As the trainer resumes a sharded checkpoint (lmyard.checkpoint.dcp_load.load_sharded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from lmyard.checkpoint.dcp import state_dict

    target = state_dict(model, opt)
    dcp.load(target, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
