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
from lmyard.data.loader import split_stream, val_sequences
from lmyard.data.shards import ShardSet
from lmyard.data.tokenizer import get_tokenizer
from lmyard.errors import UserError
from lmyard.evaluate.hellaswag import read_hellaswag
from lmyard.evaluate.validation import val_loss
from lmyard.models.base import LanguageModel, autocast
from lmyard.models.registry import model_from_checkpoint
from lmyard.run import Run
from lmyard.stages import EvalResult

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
    enc = get_tokenizer(cfg.tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in cfg.eval.prompts:
        ids = [enc.eot_token, *enc.encode_ordinary(prompt)]
        idx = model.generate(
            torch.tensor([ids], device=device),
            cfg.eval.sample_tokens,
            cfg.eval.temperature,
            cfg.eval.top_k,
            generator=gen,
            vocab_limit=enc.n_vocab,
        )
        new = idx[0, len(ids) :].tolist()
        text = enc.decode(new[: new.index(enc.eot_token)] if enc.eot_token in new else new, errors="replace")
        out.append({"prompt": prompt, "completion": text})
    return out


# ---------------------------------------------------------------- one checkpoint


def _device(e: EvalConfig) -> str:
    if e.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"eval.device is {e.device!r} but no GPU is visible; set eval.device=cpu")
        index = int(e.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"eval.device is {e.device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif e.threads:
        torch.set_num_threads(e.threads)
    return e.device


def evaluate_checkpoint(cfg: RunConfig, shards: ShardSet, step: int, run: Run | None = None) -> dict:
    """Val loss, HellaSwag (when configured) and samples of the checkpoint at `step` (of `run`, the handle of
    cfg's run, opened here when not given)."""
    t0 = time.perf_counter()
    device = _device(cfg.eval)
    run = run or Run.of(cfg)
    # a private checkpoint cache: the trainer may be downloading the same checkpoint to resume
    ckpt = resume.load_step(run.store, run.name, step, os.path.join(run.cache, "eval"))
    model = model_from_checkpoint(ckpt, device)
    val = val_sequences(split_stream(shards, cfg.store, "val", run.cache), model.config.block_size, cfg.eval.val_tokens)
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
    run = Run.of(cfg)
    if step is None:
        steps = catalog.complete_steps(run.store, run.name)
        if not steps:
            raise UserError(
                f"run {cfg.run_name!r} has no complete checkpoint in {cfg.store}: train it first, or "
                "set run_name to a run that has one"
            )
        step = steps[-1]
    return EvalResult.model_validate(evaluate_checkpoint(cfg, shards, step, run))
