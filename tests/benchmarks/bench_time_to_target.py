"""Time to a target loss: lmyard with AdamW, lmyard with Muon (train.optimizer=muon) and the plain loop with AdamW.

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_time_to_target.py --out OUT          # GPT-2 124M, one GPU
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_time_to_target.py --out OUT --sweep-lr 0.01,0.02,0.04
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_time_to_target.py --out OUT --device cpu --preset tiny \\
        --steps 4 --micro-batch 2 --corpus-mb 1 --seeds 0 --eval-every 2                         # the dry run

The corpus is text that is installed on the machine and is neither lmyard's nor CPython's sources: the
docstrings of every installed package's .py files under site-packages (torch's, transformers', numpy's, ...;
read with `ast`, each docstring once, in sorted file order), then the packages' .md, .rst, .txt and METADATA
files, the first `--corpus-mb`, sharded by lmyard's
tokenize-and-shard stage with GPT-2's BPE (bench_pylib.corpus_shards). Per seed, from that seed's initial
weights (transformers' GPT2LMHeadModel, saved and loaded by lmyard through model.init_from) on the same batches:

- plain: bench_parity's plain loop (GPT2LMHeadModel under torch.compile, torch.optim.AdamW, clip_grad_norm_,
  warmup-cosine), travelling in this repository;
- adamw: lmyard's Trainer in this process (bench_parity.lmyard_run), train.optimizer=adamw;
- muon: the same with train.optimizer=muon (train.muon_lr, train.muon_momentum; AdamW for the rest).

Each is validated every `--eval-every` steps on 64 sequences of the val split. The target is the plain loop's
final val loss (the mean over the seeds run so far); for each run the steps and the training seconds (the
first steps' compile in, evaluation out; linear between evaluations) at which its val loss first reaches it.
After every run `OUT/time_to_target.json` (every curve) and `OUT/time_to_target.md` (the table) are rewritten,
so a timeout leaves the runs finished so far.

Default arithmetic (one H200, 2026-11-29 rates at 32 x 1,024 tokens a step: lmyard 64 ms a step, the compiled
plain loop 97 ms, Muon's Newton-Schulz ~1.5 TFLOP a step more): 300 steps x 32,768 tokens = 9.8M tokens a run
(a 48 MB corpus holds ~12M GPT-2 tokens: one pass); 3 seeds x (300 x 0.064 + 300 x 0.075 + 300 x 0.097 s) =
212 s of steps, ~165 s of compiles (the first ~40 s, then inductor's cache), ~60 s corpus and shards, ~20 s
start: ~7.7 minutes. `--sweep-lr A,B,C`: one seed, lmyard+Muon at each train.muon_lr (and the plain loop
once for the target): 300 x (0.097 + 3 x 0.075) s + compiles, ~4 minutes.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import bench_parity as parity  # noqa: E402

TEXT_SUFFIXES = (".md", ".rst", ".txt")  # packages' own documentation, read after every docstring


def _docstrings(path: str) -> list[str]:
    """Every docstring of one .py file (module, classes, functions), none where it does not parse; a documentation
    file (.md, .rst, .txt, a METADATA's description) whole."""
    if path.endswith(TEXT_SUFFIXES) or path.endswith("METADATA"):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return []
        return [text] if len(text) > 200 else []
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError, RecursionError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [d for d in found if d and len(d) > 40]


def write_docs_corpus(path: Path, limit_mb: float) -> dict:
    """The JSONL of installed packages' docstrings (site-packages only: not the standard library), each text once,
    up to `limit_mb`; one document a file."""
    roots = sorted({Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")})
    ours = [HERE.parents[1].resolve() / d for d in ("lmyard", "flows", "tasks", "tests")]  # lmyard's own sources
    found = {p for r in roots for p in r.rglob("*") if p.suffix in (".py", *TEXT_SUFFIXES) or p.name == "METADATA"}
    mine = [str(p) for p in found if p.is_file() and not any(d in p.parents for d in ours)]
    files = sorted(mine, key=lambda p: (not p.endswith(".py"), p))  # docstrings first, then documentation files
    seen: set[bytes] = set()
    docs = size = 0
    with open(path, "w", encoding="utf-8") as out, Pool(min(16, os.cpu_count() or 1)) as pool:
        for found in pool.imap(_docstrings, files, chunksize=64):
            texts = []
            for d in found:
                key = hashlib.sha1(d.encode()).digest()
                if key not in seen:
                    seen.add(key)
                    texts.append(d)
            if not texts:
                continue
            line = json.dumps({"text": "\n\n".join(texts)}) + "\n"
            out.write(line)
            docs, size = docs + 1, size + len(line)
            if size > limit_mb * 1e6:
                pool.terminate()
                break
    return {"path": str(path), "documents": docs, "mb": round(size / 1e6, 1), "files_read_of": len(files)}


def prepare(a: argparse.Namespace, work: Path) -> tuple:
    """bench_parity.prepare with the docstring corpus: corpus, base config, shards, fields, train tokens, val rows."""
    from bench_pylib import corpus_shards

    from lmyard.data.shardset import ShardSet
    from lmyard.models.registry import resolve
    from lmyard.recipes import load_recipe
    from lmyard.store import open_store

    os.environ.setdefault("LMYARD_CACHE", str(work / "cache"))
    corpus = work / "docs.jsonl"
    said = write_docs_corpus(corpus, a.corpus_mb)
    print(json.dumps({"corpus": said}), file=sys.stderr, flush=True)
    base = load_recipe("smoke", parity.settings(a, work, corpus))
    shard_dict, report = corpus_shards(base, work)
    print(json.dumps({"shards": report}), file=sys.stderr, flush=True)
    shards = ShardSet.from_dict(shard_dict)
    fields = resolve(base.model, shards.n_vocab)
    store, T, t = open_store(base.store), fields["block_size"], base.train
    tokens = parity.split_tokens(store, shards, "train", a.steps * t.batch_tokens + 1)
    return corpus, base, shards, fields, store, tokens, parity.val_rows(store, shards, T, base.eval.val_tokens), said


def _lmyard(a, work, corpus, shards, store, init: str, name: str, extra: list[str]) -> dict:
    cfg = parity.lmyard_config(a, work, corpus, init, [f"eval.interval={a.eval_every}", f"run_name=ttt-{name}", *extra])
    ours = parity.lmyard_run(cfg, shards)
    shutil.rmtree(store.local_path(f"runs/{cfg.run_name}"), ignore_errors=True)  # its last checkpoint
    return {"curve": ours["curve"], "seconds": ours["seconds"]}


def _plain(a, model, tokens, val, t, T) -> dict:
    torch._dynamo.reset()
    ran = parity.plain_run(torch.compile(model) if a.device == "cuda" else model, tokens, val, t, T, a.device,
                           eval_every=a.eval_every)  # fmt: skip
    return {"curve": ran["curve"], "seconds": ran["seconds"]}


def reached(run: dict, goal: float) -> tuple[float | None, float | None]:
    """(steps, training seconds) at which the run's val loss first reaches `goal`, linear between evaluations."""
    pts = sorted((int(s), run["curve"][s], run["seconds"][s]) for s in run["curve"])
    hit = next((i for i, p in enumerate(pts) if p[1] <= goal), None)
    if hit is None:
        return None, None
    if hit == 0:
        return float(pts[0][0]), pts[0][2]
    (s0, l0, t0), (s1, l1, t1) = pts[hit - 1], pts[hit]
    f = (l0 - goal) / (l0 - l1)
    return s0 + (s1 - s0) * f, t0 + (t1 - t0) * f


def report(runs: list[dict], out: Path, meta: dict) -> None:
    """time_to_target.json and .md in `out`, from the runs so far (the target: the plain runs' mean final loss)."""
    plain = [r for r in runs if r["side"] == "plain"]
    goal = float(np.mean([r["curve"][max(r["curve"])] for r in plain])) if plain else None
    for r in runs:
        r["steps_to_target"], r["seconds_to_target"] = reached(r, goal) if goal is not None else (None, None)
    rows = [
        "| seed | side | final val loss | steps to target | seconds to target |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in runs:
        s, t = r["steps_to_target"], r["seconds_to_target"]
        rows.append(f"| {r['seed']} | {r['side']} | {r['curve'][max(r['curve'])]:.4f} | "
                    f"{'-' if s is None else f'{s:.0f}'} | {'-' if t is None else f'{t:.1f}'} |")  # fmt: skip
    means = _means(runs)
    rows += ["", "| side | mean steps to target | x plain | mean seconds to target | x plain |", "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for side, (s, t) in means.items():
        ps, pt = means.get("plain", (None, None))
        ratio = lambda x, y: "-" if x is None or not y else f"{x / y:.2f}"
        rows.append(f"| {side} | {'-' if s is None else f'{s:.0f}'} | {ratio(s, ps)} | "
                    f"{'-' if t is None else f'{t:.1f}'} | {ratio(t, pt)} |")  # fmt: skip
    steps = sorted({int(s) for r in runs for s in r["curve"]})
    rows += [
        "",
        "| step | " + " | ".join(f"{r['side']} s{r['seed']}" for r in runs) + " |",
        "|" + " ---: |" * (len(runs) + 1),
    ]
    rows += [
        f"| {s} | " + " | ".join(f"{r['curve'][s]:.4f}" if s in r["curve"] else "" for r in runs) + " |" for s in steps
    ]
    (out / "time_to_target.json").write_text(
        json.dumps({**meta, "target": goal, "means": means, "runs": runs}, indent=1)
    )
    (out / "time_to_target.md").write_text(
        f"target val loss (plain loop's mean final): {goal}\n\n" + "\n".join(rows) + "\n"
    )
    print("\n".join(rows), flush=True)


def _means(runs: list[dict]) -> dict:
    out = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = [r for r in runs if r["side"] == side]
        s = [r["steps_to_target"] for r in mine]
        t = [r["seconds_to_target"] for r in mine]
        out[side] = (float(np.mean(s)) if None not in s else None, float(np.mean(t)) if None not in t else None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for time_to_target.json and .md (written after each run)")
    p.add_argument("--preset", default="gpt2-124m", help="gpt2-124m, or tiny on the CPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--accum", type=int, default=1, help="micro-batches a step")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="AdamW's peak lr (default 6e-4)")
    p.add_argument("--muon-lr", type=float, default=None, help="train.muon_lr (default: the config's)")
    p.add_argument("--corpus-mb", type=float, default=48.0)
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2])
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--sweep-lr", type=lambda v: [float(x) for x in v.split(",")], default=None,
                   help="instead: one seed, lmyard+Muon at each train.muon_lr (and the plain loop for the target)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ttt-") as tmp:
        run(a, Path(tmp), out)


def run(a: argparse.Namespace, work: Path, out: Path) -> None:
    started = time.perf_counter()
    corpus, base, shards, fields, store, tokens, val, said = prepare(a, work)
    T, t = fields["block_size"], base.train
    meta = {"preset": a.preset, "steps": a.steps, "batch_tokens": t.batch_tokens, "lr": t.lr, "corpus": said,
            "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__}  # fmt: skip
    muon = [f"train.muon_lr={a.muon_lr}"] if a.muon_lr else []
    runs: list[dict] = []
    for seed in a.seeds[:1] if a.sweep_lr else a.seeds:
        model = parity.hf_model(fields, seed=seed)
        model.save_pretrained(work / f"init-{seed}")
        sides = [("plain", None)]
        if a.sweep_lr:
            sides += [(f"muon lr {lr:g}", ["train.optimizer=muon", f"train.muon_lr={lr}"]) for lr in a.sweep_lr]
        else:
            sides += [("adamw", ["train.optimizer=adamw"]), ("muon", ["train.optimizer=muon", *muon])]
        for side, extra in sides:
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):
                if extra is None:
                    ran = _plain(a, model, tokens, val, t, T)
                    del model
                else:
                    name = f"{side.replace(' ', '-')}-{seed}"
                    ran = _lmyard(a, work, corpus, shards, store, f"init-{seed}", name, extra)
            runs.append({"seed": seed, "side": side, "wall_s": round(time.perf_counter() - t0, 1), **ran})
            report(runs, out, {**meta, "elapsed_s": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
