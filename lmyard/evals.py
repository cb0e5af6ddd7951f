"""Evaluation of a checkpoint: validation loss on the fixed val set, and samples.

Runs in one process on its own device (CPU by default), independent of the
trainer: it reads the checkpoint and the shards from the store.
"""

from __future__ import annotations

import torch

from lmyard import checkpoint
from lmyard.config import RunConfig
from lmyard.data import default_cache_dir, split_stream, val_sequences
from lmyard.model import GPT, GPTConfig
from lmyard.shards import ShardSet
from lmyard.store import open_store
from lmyard.tokenizer import get_tokenizer


def load_model(ckpt: checkpoint.Checkpoint, device: str = "cpu") -> GPT:
    model = GPT(GPTConfig(**ckpt.state["model"]))
    model.load_state_dict(ckpt.model)
    return model.to(device).eval()


@torch.no_grad()
def val_loss(model: GPT, val: torch.Tensor, batch: int = 16, device: str = "cpu") -> float:
    total, n = 0.0, 0
    for i in range(0, val.size(0), batch):
        rows = val[i:i + batch].to(device)
        loss = model(rows[:, :-1], rows[:, 1:])
        total += float(loss) * rows.size(0)
        n += rows.size(0)
    return total / n


def samples(model: GPT, cfg: RunConfig, seed: int = 0, device: str = "cpu") -> list[dict]:
    enc = get_tokenizer(cfg.tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in cfg.eval.prompts:
        ids = [enc.eot_token, *enc.encode_ordinary(prompt)]
        idx = model.generate(torch.tensor([ids], device=device), cfg.eval.sample_tokens, cfg.eval.temperature,
                             cfg.eval.top_k, generator=gen, vocab_limit=enc.n_vocab)
        new = [t for t in idx[0, len(ids):].tolist()]
        text = enc.decode(new[:new.index(enc.eot_token)] if enc.eot_token in new else new, errors="replace")
        out.append({"prompt": prompt, "completion": text})
    return out


def evaluate_latest(cfg: RunConfig, shards: ShardSet, device: str = "cpu") -> dict:
    """Val loss and samples of the newest complete checkpoint of cfg.run_name."""
    store, cache = open_store(cfg.store), default_cache_dir()
    ckpt = checkpoint.load_latest(store, cfg.run_name, cache)
    if ckpt is None:
        raise RuntimeError(f"no complete checkpoint under {store.uri(checkpoint.checkpoints_prefix(cfg.run_name))}")
    model = load_model(ckpt, device)
    val = val_sequences(split_stream(shards, cfg.store, "val", cache), model.config.block_size,
                        cfg.eval.val_tokens)
    return {"step": ckpt.step, "checkpoint": ckpt.uri, "tokens_seen": ckpt.state["tokens_seen"],
            "val_loss": val_loss(model, val, device=device), "samples": samples(model, cfg, device=device)}
