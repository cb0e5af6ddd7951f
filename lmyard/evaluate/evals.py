"""Evaluation of one checkpoint: every evaluation of lmyard.evaluate.registry that the run's `eval` enables
(val loss, HellaSwag-format multiple choice, lm-eval, samples), each a typed result.

    python -m lmyard.dispatch evaluate --spec spec.json     (an EvalSpec; see lmyard.stages)

Runs in its own process on its own device (`eval.device`: cpu, or a spare
GPU), independent of the trainer: it reads the checkpoint and the shards
from the store, so training keeps its devices to itself.

- val loss: the mean token loss over the fixed val sequences, by the trainer's
  own routine (lmyard.evaluate.validation: float64 sums per sequence, bf16
  autocast on CUDA), so it equals the trainer's `loss/val` at that step.
- HellaSwag, scored as nanoGPT does: for each of the 4 endings, the loss of
  the ending's tokens given the context. `acc`: the ending with the lowest
  summed loss is right; `acc_norm`: the lowest mean loss per token.
- samples: fixed prompts, a fixed seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmyard.config import RunConfig
from lmyard.data.loader import split_stream, val_sequences
from lmyard.data.tokenizer import get_tokenizer
from lmyard.evaluate.hellaswag import read_hellaswag
from lmyard.evaluate.spec import Context
from lmyard.evaluate.validation import val_loss
from lmyard.models.base import LanguageModel, autocast

# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class ValLoss:
    loss: float  # mean token loss over the fixed val sequences


@dataclass(frozen=True)
class Choice:
    example: int
    label: int
    pred: int  # the ending with the lowest summed loss
    pred_norm: int  # the ending with the lowest mean loss per token
    losses: list[float]
    mean_losses: list[float]


@dataclass(frozen=True)
class MultipleChoice:
    acc: float
    acc_norm: float
    n: int
    rows: list[Choice] = field(default_factory=list)


@dataclass(frozen=True)
class Completion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Samples:
    items: list[Completion]


@dataclass(frozen=True)
class HarnessScores:
    metrics: dict[str, float]  # lm-eval's metrics, flattened `task/metric`
    results: dict = field(default_factory=dict)


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


def hellaswag(model: LanguageModel, enc, examples: list[dict], device: str = "cpu") -> MultipleChoice:
    """acc (lowest summed ending loss) and acc_norm (lowest mean ending loss), with per-example rows."""
    correct = correct_norm = 0
    rows = []
    for i, ex in enumerate(examples):
        tokens, mask = render_example(enc, ex, model.config.block_size)
        summed, mean = ending_losses(model, tokens, mask, device)
        pred, pred_norm = int(summed.argmin()), int(mean.argmin())
        correct += pred == ex["label"]
        correct_norm += pred_norm == ex["label"]
        losses, means = [round(float(x), 4) for x in summed], [round(float(x), 4) for x in mean]
        rows.append(Choice(i, ex["label"], pred, pred_norm, losses, means))
    n = len(examples)
    return MultipleChoice(correct / n, correct_norm / n, n, rows)


# ---------------------------------------------------------------- samples


def samples(model: LanguageModel, cfg: RunConfig, seed: int = 0, device: str = "cpu") -> Samples:
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
) -> Samples:
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
        out.append(Completion(prompt, text))
    return Samples(out)


# ---------------------------------------------------------------- the built-in evaluations' runs


def run_val_loss(ctx: Context) -> ValLoss:
    cfg, model = ctx.cfg, ctx.model
    val = val_sequences(
        split_stream(ctx.shards, cfg.store, "val", ctx.cache), model.config.block_size, cfg.eval.val_tokens
    )
    return ValLoss(val_loss(model, val, cfg.train.micro_batch, ctx.device))


def run_hellaswag(ctx: Context) -> MultipleChoice:
    e = ctx.cfg.eval
    assert e.hellaswag is not None  # its spec is enabled only then
    examples = read_hellaswag(e.hellaswag, e.hellaswag_split, e.hellaswag_limit)
    return hellaswag(ctx.model, get_tokenizer(ctx.cfg.tokenizer), examples, ctx.device)


def run_harness(ctx: Context) -> HarnessScores:
    """lm-evaluation-harness on the checkpoint's Hugging Face export."""
    from lmyard.evaluate import harness

    out = harness.evaluate(ctx.checkpoint, ctx.cfg, ctx.device)
    return HarnessScores(out["metrics"], out["results"])


def run_samples(ctx: Context) -> Samples:
    return samples(ctx.model, ctx.cfg, device=ctx.device)
