"""Evaluation of one checkpoint: val loss, HellaSwag-format multiple choice, samples.

    python -m lmyard.stages evaluate --spec spec.json     (an EvalSpec; see lmyard.stages)

Runs in its own process on its own device (`eval.device`: cpu, or a spare
GPU), independent of the trainer: it reads the checkpoint and the shards
from the store, so training keeps its devices to itself.

- val loss: the mean token loss over the fixed val sequences, by the trainer's
  own routine (lmyard.evaluate.validation: float64 sums per sequence, bf16
  autocast on CUDA), so it equals the trainer's `val/loss` at that step.
- HellaSwag, scored as nanoGPT does: for each of the 4 endings, the loss of
  the ending's tokens given the context. `acc`: the ending with the lowest
  summed loss is right; `acc_norm`: the lowest mean loss per token.
- samples: fixed prompts, a fixed seed.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from lmyard.checkpoint import catalog, resume
from lmyard.config import EvalConfig, RunConfig
from lmyard.contracts import EvalResult
from lmyard.data.loader import default_cache_dir, split_stream, val_sequences
from lmyard.data.shards import ShardSet
from lmyard.data.tokenizer import get_tokenizer
from lmyard.errors import UserError
from lmyard.evaluate.hellaswag import read_hellaswag
from lmyard.evaluate.validation import autocast, val_loss
from lmyard.models.base import LanguageModel
from lmyard.models.registry import model_from_checkpoint
from lmyard.store import open_store

# ---------------------------------------------------------------- HellaSwag


def render_example(enc, ex: dict, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (4, L) of context + each ending, and a mask (4, L) that is 1 on the ending's tokens.

    Contexts that do not fit the block lose tokens from their start; rows are zero-padded.
    """
    ctx = enc.encode_ordinary(ex["ctx"])
    rows, masks = [], []
    for ending in ex["endings"]:
        end = enc.encode_ordinary(" " + ending)[: block_size - 1]
        keep = ctx[max(0, len(ctx) + len(end) - block_size) :]
        rows.append(keep + end)
        masks.append([0] * len(keep) + [1] * len(end))
    width = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return tokens, mask


@torch.no_grad()
def ending_losses(
    model: LanguageModel, tokens: torch.Tensor, mask: torch.Tensor, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, mean) cross-entropy of each row's masked tokens, each token predicted from those before it."""
    tokens, mask = tokens.to(device), mask.to(device)
    with autocast(device):
        logits = model(tokens)
    logits = logits[:, :-1, :].float()
    targets, m = tokens[:, 1:], mask[:, 1:].float()
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    summed = (losses.view(targets.shape) * m).sum(dim=1)
    return summed.cpu(), (summed / m.sum(dim=1)).cpu()


def hellaswag(model: LanguageModel, enc, examples: list[dict], device: str = "cpu") -> dict:
    """acc (lowest summed ending loss) and acc_norm (lowest mean ending loss), with per-example rows."""
    correct = correct_norm = 0
    rows = []
    for i, ex in enumerate(examples):
        tokens, mask = render_example(enc, ex, model.config.block_size)
        summed, mean = ending_losses(model, tokens, mask, device)
        pred, pred_norm = int(summed.argmin()), int(mean.argmin())
        correct += pred == ex["label"]
        correct_norm += pred_norm == ex["label"]
        rows.append(
            {
                "example": i,
                "label": ex["label"],
                "pred": pred,
                "pred_norm": pred_norm,
                "losses": [round(float(x), 4) for x in summed],
                "mean_losses": [round(float(x), 4) for x in mean],
            }
        )
    n = len(examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "rows": rows}


# ---------------------------------------------------------------- samples


def samples(model: LanguageModel, cfg: RunConfig, seed: int = 0, device: str = "cpu") -> list[dict]:
    """eval.prompts' completions, as every evaluation samples them."""
    e = cfg.eval
    return complete(
        model, get_tokenizer(cfg.tokenizer), e.prompts, e.sample_tokens, e.temperature, e.top_k, seed, device
    )


def complete(
    model: LanguageModel,
    enc,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int = 0,
    device: str = "cpu",
) -> list[dict]:
    """Each prompt (after the end-of-text token, as training documents begin) continued up to max_new_tokens,
    cut at the next end-of-text token; one generator seeded with `seed` for all of them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = [enc.eot_token, *enc.encode_ordinary(prompt)][-model.config.block_size :]
        idx = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens,
            temperature,
            top_k,
            generator=gen,
            vocab_limit=enc.n_vocab,
        )
        new = idx[0, len(ids) :].tolist()
        text = enc.decode(new[: new.index(enc.eot_token)] if enc.eot_token in new else new, errors="replace")
        out.append({"prompt": prompt, "completion": text})
    return out


# ---------------------------------------------------------------- one checkpoint


def device_for(e: EvalConfig) -> str:
    if e.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"eval.device is {e.device!r} but no GPU is visible; set eval.device=cpu")
        index = int(e.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"eval.device is {e.device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif e.threads:
        torch.set_num_threads(e.threads)
    return e.device


def evaluate_checkpoint(cfg: RunConfig, shards: ShardSet, step: int) -> dict:
    """Val loss, HellaSwag (when configured) and samples of the checkpoint at `step`."""
    t0 = time.perf_counter()
    device = device_for(cfg.eval)
    store, cache = open_store(cfg.store), default_cache_dir()
    # a private checkpoint cache: the trainer may be downloading the same checkpoint to resume
    ckpt = resume.load_step(store, cfg.run_name, step, os.path.join(cache, "eval"))
    model = model_from_checkpoint(ckpt, device)
    val = val_sequences(split_stream(shards, cfg.store, "val", cache), model.config.block_size, cfg.eval.val_tokens)
    result = {
        "step": ckpt.step,
        "checkpoint": ckpt.uri,
        "tokens_seen": ckpt.state.tokens_seen,
        "trainer_val_loss": ckpt.state.val_loss,
        "device": device,
        "val_loss": val_loss(model, val, cfg.train.micro_batch, device),
    }
    if cfg.eval.hellaswag:
        examples = read_hellaswag(cfg.eval.hellaswag, cfg.eval.hellaswag_split, cfg.eval.hellaswag_limit)
        result["hellaswag"] = hellaswag(model, get_tokenizer(cfg.tokenizer), examples, device)
    if cfg.eval.harness_tasks:  # lm-evaluation-harness on the checkpoint's Hugging Face export
        from lmyard.evaluate import harness

        result["harness"] = harness.evaluate(ckpt, cfg, device)
    result["samples"] = samples(model, cfg, device=device)
    result["eval_s"] = round(time.perf_counter() - t0, 3)
    return result


def evaluate_latest(cfg: RunConfig, shards: ShardSet, step: int | None = None) -> EvalResult:
    """Evaluate checkpoint `step` of cfg.run_name, or its newest complete one."""
    if step is None:
        steps = catalog.complete_steps(open_store(cfg.store), cfg.run_name)
        if not steps:
            raise UserError(
                f"run {cfg.run_name!r} has no complete checkpoint in {cfg.store}: train it first, or "
                "set run_name to a run that has one"
            )
        step = steps[-1]
    return EvalResult.model_validate(evaluate_checkpoint(cfg, shards, step))
