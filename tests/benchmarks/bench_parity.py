"""Loss per step: lmyard's trainer against a plain PyTorch loop, from the same weights on the same batches.

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_parity.py                      # GPT-2 124M, 1 GPU, bf16
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_parity.py --preset llama-1b
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_parity.py --device cpu --preset tiny --steps 4 \\
        --accum 1 --micro-batch 2 --corpus-mb 2 --configs fused loss

The corpus is the Python installation's own .py files (bench_pylib.write_corpus, the first `--corpus-mb`),
sharded by lmyard's tokenize-and-shard stage with GPT-2's BPE (r50k_base). The plain side is Hugging Face's
GPT2LMHeadModel or LlamaForCausalLM made with its own initialisation and saved with save_pretrained
(safetensors): lmyard starts from that folder (model.init_from). The plain loop reads the train split's
shards through lmyard's shard format reader and cuts global sequence k as tokens [k*T, (k+1)*T] (step s reads
sequences [s*N, (s+1)*N), N = batch_tokens / T, micro-batches in order), runs F.cross_entropy on the model's
logits, torch.optim.AdamW (decay on tensors of 2 dimensions or more, none on biases and norm gains),
torch.nn.utils.clip_grad_norm_ and a linear-warmup cosine schedule written out here; under torch.autocast
bf16 on CUDA, float32 on the CPU, uncompiled.

lmyard's side is its Trainer in this process (lmyard.train.trainer.Trainer: the model wrapped and compiled as
in a run, its loader and prefetcher, train_step, the clipped AdamW update, validation), with no lineage: the
per-step train loss and the final val loss come from the trainer's metrics sink (a MetricsSink that keeps what
it is given), every step (train.log_interval=1). It runs once with every fused component on, then once with
each switched off:

- `loss`: lmyard.models.losses.linear_cross_entropy's Triton kernel (no switch in lmyard: the script sets
  `lmyard.models.ops.cross_entropy.triton = None`, its torch path);
- `mlp_epilogues`: GPT-2's MLP in cuBLASLt's epilogues (`LMYARD_MLP_EPILOGUES=0`; here `mlp.ENABLED`, read
  at import);
- `adamw_kernel`: AdamW's one-launch Triton step (no switch: `AdamW._fusable` answers False, torch's step);
- `grad_norm_kernel`: the one-launch gradient norm (no switch: `optim._summable` answers False);
- `rope_op`: Llama's RoPE op (no switch: `rope._fusable` answers False);
- `compile`: `train.compile=false`;
- `residual_bf16`: `train.residual_dtype=bfloat16` against the default float32 (under ddp);
- `fa4` (with `--fa4`): `model.attention=fa4` against `auto`.

The row-sharded token table (train.fsdp_embedding) needs FSDP2 on two ranks or more: not run here (one GPU).
Each configuration prints one JSON line: the per-step loss difference lmyard - plain (mean, max abs, at the
last step) and each side's final val loss.

On the GPU machine (Python 3.12, torch, numpy, tiktoken, transformers) lmyard needs, as wheels in
`.whl/bench-py312` (docs/performance.md): pydantic (pydantic-core, annotated-types, typing-extensions,
typing-inspection), pydantic-settings (python-dotenv), pyyaml, psutil, safetensors, tqdm. Neither MLflow,
Prefect, boto3 nor docker is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# ---------------------------------------------------------------- the plain side (tests/integration/test_parity.py uses it too)


def hf_model(fields: dict, seed: int) -> torch.nn.Module:
    """A Hugging Face model of lmyard's resolved model fields (model_config's), initialised by transformers
    under `seed`, float32, on the CPU. GPT-2's GELU is `gelu_pytorch_tanh` (torch's tanh GELU, as lmyard's)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if "ffn_hidden" not in fields:  # GPT-2
        config = GPT2Config(
            vocab_size=fields["vocab_size"],
            n_positions=fields["block_size"],
            n_embd=fields["n_embd"],
            n_layer=fields["n_layer"],
            n_head=fields["n_head"],
            activation_function="gelu_pytorch_tanh",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        )
        return GPT2LMHeadModel(config)
    rope = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    config = LlamaConfig(
        vocab_size=fields["vocab_size"],
        hidden_size=fields["n_embd"],
        intermediate_size=fields["ffn_hidden"],
        num_hidden_layers=fields["n_layer"],
        num_attention_heads=fields["n_head"],
        num_key_value_heads=fields["n_kv_head"],
        max_position_embeddings=fields["block_size"],
        rms_norm_eps=fields["norm_eps"],
        rope_theta=fields["rope_theta"],  # transformers 4; 5 reads rope_parameters
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaForCausalLM(config)


def split_tokens(store, shards, split: str, count: int) -> np.ndarray:
    """The first `count` tokens of a split of `shards` (a ShardSet in `store`, a local-folder lmyard store; its
    shards in manifest order) through lmyard's shard format reader."""
    from lmyard.data.shards import read_shard
    from lmyard.layout import ShardLayout

    parts, have = [], 0
    for meta in shards.files(split):
        if have >= count:
            break
        arr = read_shard(store.local_path(ShardLayout(shards.address).file(meta["name"])))
        parts.append(np.asarray(arr[: count - have], dtype=np.int64))
        have += parts[-1].size
    if have < count:
        raise SystemExit(f"the {split} split holds {have} tokens, fewer than the {count} the run reads")
    return np.concatenate(parts)


def lr_at(step: int, lr: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps to lr, then cosine to lr * min_ratio at max_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))


def plain_run(
    model: torch.nn.Module, tokens: np.ndarray, val: np.ndarray, t, T: int, device: str, eval_every: int = 0
) -> dict:
    """The plain loop over `t.max_steps` steps (t: lmyard's TrainConfig, for its numbers only): per-step train
    loss (the mean of the micro-batches' mean losses), the val loss (the mean token loss over the val sequences,
    val: (n, T+1)) at the end and every `eval_every` steps ({step: loss}), and the training seconds at each of
    those steps (evaluation time left out, the first steps' compile time in)."""
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
    B, N = t.micro_batch, t.batch_tokens // T
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    losses, curve, seconds, trained_s = [], {}, {}, 0.0
    for step in range(t.max_steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t.lr, t.warmup_steps, t.max_steps, t.min_lr_ratio)
        total = torch.zeros((), device=device)
        for m in range(N // B):
            first = step * N + m * B
            rows = torch.from_numpy(np.stack([tokens[k * T : k * T + T + 1] for k in range(first, first + B)]))
            with cast:
                loss = _loss(model, rows.to(device))
            (loss / (N // B)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total / (N // B)))
        trained_s += time.perf_counter() - t0
        if step + 1 == t.max_steps or (eval_every and (step + 1) % eval_every == 0):
            curve[step + 1], seconds[step + 1] = plain_val(model, val, B, device, cast), trained_s
    return {"train": losses, "val": curve[t.max_steps], "curve": curve, "seconds": seconds}


def plain_val(model: torch.nn.Module, val: np.ndarray, B: int, device: str, cast) -> float:
    model.eval()
    with torch.no_grad(), cast:
        val_sum = sum(float(_loss(model, torch.from_numpy(val[i : i + B]).to(device))) * len(val[i : i + B])
                      for i in range(0, len(val), B))  # fmt: skip
    model.train()
    return val_sum / len(val)


def val_rows(store, shards, T: int, val_tokens: int) -> np.ndarray:
    """The val sequences lmyard scores: consecutive sequences of T+1 tokens from the start of the val split."""
    n = min(val_tokens // T, (shards.tokens("val") - 1) // T)
    tokens = split_tokens(store, shards, "val", n * T + 1)
    return np.stack([tokens[i * T : i * T + T + 1] for i in range(n)])


def compare(ours: list[float], theirs: list[float]) -> dict:
    diff = np.asarray(ours, dtype=np.float64) - np.asarray(theirs, dtype=np.float64)
    return {
        "steps": len(diff),
        "loss_diff_mean": float(diff.mean()),
        "loss_diff_max_abs": float(np.abs(diff).max()),
        "loss_diff_last": float(diff[-1]),
    }


# ---------------------------------------------------------------- lmyard's side and the configurations

# name -> (what is switched off, lmyard's switch or "none"); the kernels' switches are made by `switched_off`
SWITCHES = {
    "fused": ("nothing: every fused component on", "-"),
    "loss": ("linear_cross_entropy's Triton kernel", "none (lmyard.models.ops.cross_entropy.triton = None)"),
    "mlp_epilogues": ("GPT-2's MLP in cuBLASLt's epilogues", "LMYARD_MLP_EPILOGUES=0"),
    "adamw_kernel": ("AdamW's one-launch Triton step", "none (AdamW._fusable -> False: torch's fused AdamW)"),
    "grad_norm_kernel": ("the one-launch gradient norm", "none (optim._summable -> False: torch's foreach norm)"),
    "rope_op": ("Llama's RoPE op", "none (rope._fusable -> False: the plain formula)"),
    "compile": ("torch.compile", "train.compile=false"),
    "residual_bf16": ("a float32 residual stream (bf16 instead)", "train.residual_dtype=bfloat16"),
    "fa4": ("PyTorch's SDPA (FlashAttention-4 instead)", "model.attention=fa4"),
}
OVERRIDES = {
    "compile": ["train.compile=false"],
    "residual_bf16": ["train.residual_dtype=bfloat16"],
    "fa4": ["model.attention=fa4"],
}


@contextlib.contextmanager
def switched_off(name: str):
    """The kernel `name` replaced by its torch path for the duration (lmyard has no switch for most of them)."""
    from lmyard.models import mlp
    from lmyard.models.ops import cross_entropy, rope
    from lmyard.train import optim

    target = {
        "loss": (cross_entropy, "triton", None),
        "mlp_epilogues": (mlp, "ENABLED", False),
        "adamw_kernel": (optim.AdamW, "_fusable", lambda self, group, params: False),
        "grad_norm_kernel": (optim, "_summable", lambda grads: False),
        "rope_op": (rope, "_fusable", lambda *args: False),
    }.get(name)
    if target is None:
        yield
        return
    owner, attr, value = target
    kept = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, kept)


class Recorder:
    """A MetricsSink (lmyard.tracking.sink) that keeps every point it is given: {key: {step: value}}."""

    def __init__(self):
        self.points: dict[str, dict[int, float]] = {}
        self.at: dict[str, dict[int, float]] = {}  # key -> {step: time.perf_counter() when it was logged}

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = time.perf_counter()
        for key, value in metrics.items():
            self.points.setdefault(key, {})[step] = float(value)
            self.at.setdefault(key, {})[step] = now

    def trained_s(self, start: float) -> dict[int, float]:
        """The training seconds since `start` at each validated step: evaluation time left out (a validation's
        time is from its step's loss/train point to its loss/val point)."""
        train, val = self.at["loss/train"], self.at.get("loss/val", {})
        out, evals_s = {}, 0.0
        for step in sorted(val):
            out[step] = train[step] - start - evals_s
            evals_s += val[step] - train[step]
        return out

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def lmyard_run(cfg, shards) -> dict:
    """lmyard's Trainer in this process, no lineage: per-step train loss and the final val loss from its sink.
    Its log lines go to stderr (stdout holds the JSON lines)."""
    from lmyard.run import Run
    from lmyard.stages import TrainSpec
    from lmyard.train.distributed import setup_distributed
    from lmyard.train.trainer import Trainer

    sink = Recorder()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        Trainer(TrainSpec(config=cfg, shards=shards), Run.of(cfg), setup_distributed(cfg), sink).train()
    steps = cfg.train.max_steps
    return {
        "train": [sink.points["loss/train"][s] for s in range(1, steps + 1)],
        "val": sink.points["loss/val"][steps],
        "curve": sink.points["loss/val"],
        "seconds": sink.trained_s(start),
    }


def settings(a: argparse.Namespace, work: Path, corpus: Path) -> list[str]:
    cuda = a.device == "cuda"
    llama = a.preset.startswith("llama")
    T = {"tiny": 128, "llama-tiny": 64}.get(a.preset, 1024 if not llama else 2048)
    micro = a.micro_batch or (16 if a.preset == "gpt2-124m" else 4)
    return [
        f"store={work / 'store'}",
        f"data.source={corpus}",
        "data.val_every=50",
        "tokenizer.name=gpt2",
        f"model.preset={a.preset}",
        f"train.device={a.device}",
        f"train.max_steps={a.steps}",
        f"train.micro_batch={micro}",
        f"train.batch_tokens={micro * T * a.accum}",
        f"train.lr={a.lr or (3e-4 if llama else 6e-4)}",
        "train.warmup_steps=20",
        "train.log_interval=1",
        f"eval.interval={a.steps}",
        f"eval.val_tokens={65536 if cuda else 4096}",
        f"checkpoint.interval={a.steps}",
        *a.overrides,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-124m", help="gpt2-124m, llama-1b, or tiny / llama-tiny on the CPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--accum", type=int, default=4, help="micro-batches a step")
    p.add_argument("--micro-batch", type=int, default=None, help="default 16 (gpt2-124m), else 4")
    p.add_argument("--lr", type=float, default=None, help="default 6e-4 (GPT-2), 3e-4 (Llama)")
    p.add_argument(
        "--corpus-mb", type=float, default=40.0, help="the first MB of the .py files (40: 16.5M GPT-2 tokens)"
    )
    p.add_argument("--configs", nargs="*", default=None, help=f"of {', '.join(SWITCHES)}; default: all that apply")
    p.add_argument("--fa4", action="store_true", help="also the fa4 configuration (Hopper or Blackwell)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tmp", default=None, help="work folder (default: a new temporary one, removed)")
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="end to end over these initial-weight seeds (e.g. 0,1,2,3) instead of the switches")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=100, help="with --seeds: validate every this many steps")
    p.add_argument("--plain-compile", action="store_true", help="with --seeds: torch.compile the plain model")
    p.add_argument("--target", type=float, default=None, help="with --seeds: the val loss to time (default: the "
                   "plain loop's mean final val loss)")  # fmt: skip
    a = p.parse_args()
    llama = a.preset.startswith("llama")
    family_only = {"mlp_epilogues": not llama, "rope_op": llama, "fa4": a.fa4}  # the rest apply to both
    configs = a.configs or [c for c in SWITCHES if family_only.get(c, True)]
    with contextlib.ExitStack() as stack:
        work = Path(a.tmp) if a.tmp else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-")))
        seeds_run(a, work) if a.seeds else run(a, configs, work)


def prepare(a: argparse.Namespace, work: Path) -> tuple:
    """The corpus, its shards, the resolved model fields, and the plain side's train tokens and val rows."""
    from bench_pylib import corpus_shards, write_corpus

    from lmyard.data.shardset import ShardSet
    from lmyard.models.registry import resolve
    from lmyard.recipes import load_recipe
    from lmyard.store import open_store

    os.environ.setdefault("LMYARD_CACHE", str(work / "cache"))
    corpus = work / "pylib.jsonl"
    print(json.dumps({"corpus": write_corpus(corpus, a.corpus_mb)}), file=sys.stderr, flush=True)
    base = load_recipe("smoke", settings(a, work, corpus))
    shard_dict, report = corpus_shards(base, work)
    print(json.dumps({"shards": report}), file=sys.stderr, flush=True)
    shards = ShardSet.from_dict(shard_dict)
    fields = resolve(base.model, shards.n_vocab)
    store, T, t = open_store(base.store), fields["block_size"], base.train
    tokens = split_tokens(store, shards, "train", a.steps * t.batch_tokens + 1)
    return corpus, base, shards, fields, store, tokens, val_rows(store, shards, T, base.eval.val_tokens)


def lmyard_config(a: argparse.Namespace, work: Path, corpus: Path, name: str, extra: list[str]):
    from lmyard.recipes import load_recipe

    if a.device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return load_recipe(
        "smoke",
        [*settings(a, work, corpus), f"model.init_from={work / name}", f"run_name=parity-{name}", *extra],
    )


def run(a: argparse.Namespace, configs: list[str], work: Path) -> None:
    import shutil

    corpus, base, shards, fields, store, tokens, val = prepare(a, work)
    T, t = fields["block_size"], base.train
    model = hf_model(fields, seed=base.train.seed)
    model.save_pretrained(work / "init")
    t0 = time.perf_counter()
    plain = plain_run(model, tokens, val, t, T, a.device)
    plain_s = time.perf_counter() - t0
    del model
    for name in configs:
        cfg = lmyard_config(a, work, corpus, "init", [f"run_name=parity-{name}", *OVERRIDES.get(name, [])])
        t0 = time.perf_counter()
        with switched_off(name):
            ours = lmyard_run(cfg, shards)
        shutil.rmtree(store.local_path(f"runs/{cfg.run_name}"), ignore_errors=True)  # its last checkpoint
        off, switch = SWITCHES[name]
        line = {"preset": a.preset, "device": a.device, "config": name, "switched_off": off, "switch": switch,
                **compare(ours["train"], plain["train"]), "val_loss_lmyard": ours["val"], "val_loss_plain": plain["val"],
                "first_loss_lmyard": ours["train"][0], "first_loss_plain": plain["train"][0],
                "seconds_lmyard": round(time.perf_counter() - t0, 1), "seconds_plain": round(plain_s, 1)}  # fmt: skip
        print(json.dumps(line), flush=True)


def seeds_run(a: argparse.Namespace, work: Path) -> None:
    """End to end, per seed: the plain loop and lmyard (every component on) from the seed's initial weights on
    the same batches, validated every --eval-every steps; one JSON line per seed, then the summary."""
    import shutil

    corpus, base, shards, fields, store, tokens, val = prepare(a, work)
    T, t = fields["block_size"], base.train
    runs = []
    for seed in a.seeds:
        model = hf_model(fields, seed=seed)
        model.save_pretrained(work / f"init-{seed}")
        torch._dynamo.reset()
        plain = plain_run(torch.compile(model) if a.plain_compile else model, tokens, val, t, T, a.device,
                          eval_every=a.eval_every)  # fmt: skip
        del model
        cfg = lmyard_config(a, work, corpus, f"init-{seed}", [f"eval.interval={a.eval_every}"])
        ours = lmyard_run(cfg, shards)
        shutil.rmtree(store.local_path(f"runs/{cfg.run_name}"), ignore_errors=True)
        line = {"seed": seed, **compare(ours["train"], plain["train"]),
                **{f"{k}_{side}": r[k] for side, r in (("lmyard", ours), ("plain", plain)) for k in ("curve", "seconds")}}  # fmt: skip
        print(json.dumps(line), flush=True)
        runs.append(line)
    print(json.dumps(summarize(runs, a.target)), flush=True)


def summarize(runs: list[dict], target: float | None) -> dict:
    """Mean and spread of val loss per evaluation, and each side's mean training seconds to the target (the
    plain loop's mean final val loss unless given), linear between evaluations."""
    steps = sorted(runs[0]["curve_plain"])
    table = []
    for s in steps:
        ours = np.array([r["curve_lmyard"][s] for r in runs])
        plain = np.array([r["curve_plain"][s] for r in runs])
        table.append({"step": s, "lmyard_mean": float(ours.mean()), "plain_mean": float(plain.mean()),
                      "diff": float(ours.mean() - plain.mean()), "lmyard_std": float(ours.std(ddof=1)) if len(runs) > 1 else 0.0,
                      "plain_std": float(plain.std(ddof=1)) if len(runs) > 1 else 0.0})  # fmt: skip
    goal = target if target is not None else table[-1]["plain_mean"]
    return {"evaluations": table, "target": goal, **{f"seconds_to_target_{side}": to_target(runs, side, goal)
            for side in ("lmyard", "plain")}}  # fmt: skip


def to_target(runs: list[dict], side: str, goal: float) -> float | None:
    """The mean over seeds of the training seconds at which the val loss first reaches `goal` (None: not reached)."""
    found = []
    for r in runs:
        curve, secs = r[f"curve_{side}"], r[f"seconds_{side}"]
        pts = sorted((int(s), curve[s], secs[s]) for s in curve)
        hit = next((i for i, p in enumerate(pts) if p[1] <= goal), None)
        if hit is None:
            return None
        if hit == 0:
            found.append(pts[0][2])
            continue
        (_, l0, s0), (_, l1, s1) = pts[hit - 1], pts[hit]
        found.append(s0 + (s1 - s0) * (l0 - goal) / (l0 - l1))
    return float(np.mean(found))


if __name__ == "__main__":
    main()
