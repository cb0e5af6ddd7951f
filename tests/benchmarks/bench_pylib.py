"""GPT-2 124M on the Python installation's own source files: does the validation loss fall at every evaluation?

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_pylib.py                 # shuffled (both shuffles on)
    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_pylib.py --no-shuffle    # path order, as before
    python tests/benchmarks/bench_pylib.py --shard-only                           # corpus + shards, no GPU

It writes a JSONL of every .py file under the Python installation's lib folder
(the stdlib folder, which holds site-packages on a system install, plus a
virtual environment's site-packages), one document per file in sorted path
order, as a local glob gives them: similar files arrive together. Then it runs
the tokenize-and-shard stage (GPT-2 BPE, data.val_every=50, with
data.shuffle_documents and data.shuffle_sequences on unless --no-shuffle) and
trains GPT-2 124M for 400 steps of 65,536 tokens (16 x 1024 x 4 micro-steps)
on one GPU through torchrun -m lmyard.dispatch train, evaluating every 100 steps (as the measurement in the issue).
Prints the corpus, the shard set, every evaluation and whether the validation
loss fell at each one, as JSON. Needs: torch with CUDA, numpy, tiktoken with
GPT-2's ranks, pydantic, pyyaml (see docs/performance.md for offline wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lmyard.recipes import load_recipe  # noqa: E402

VAL_LINE = re.compile(r"step (\d+) \| val loss ([\d.]+)")
TRAIN_LINE = re.compile(r"step (\d+)/\d+ \| loss ([\d.]+)")
TRAIN = {
    "model.preset": "gpt2-124m",
    "tokenizer.name": "gpt2",
    "train.max_steps": 400,
    "train.batch_tokens": 65536,
    "train.micro_batch": 16,
    "train.lr": 6e-4,
    "train.warmup_steps": 40,
    "train.log_interval": 10,
    "train.device": "cuda",
    "launch.nproc_per_node": 1,
    "eval.interval": 100,
    "eval.val_tokens": 131072,
    "checkpoint.interval": 100000,
    "data.val_every": 50,
}


def lib_folders() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")})
    return [r for r in roots if not any(r != o and o in r.parents for o in roots)]  # no folder twice


def write_corpus(path: Path, limit_mb: float | None = None) -> dict:
    """The JSONL of the module docstring; with `limit_mb`, only the first files up to that size."""
    files = sorted({p for root in lib_folders() for p in root.rglob("*.py") if p.is_file()})
    docs = skipped = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for p in files:
            if limit_mb is not None and size > limit_mb * 1e6:
                break
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            line = json.dumps({"text": text, "path": str(p)}) + "\n"
            out.write(line)
            docs, size = docs + 1, size + len(line)
    return {
        "roots": [str(r) for r in lib_folders()],
        "documents": docs,
        "not_utf8": skipped,
        "mb": round(size / 1e6, 1),
    }


def train(cfg, shards: dict, work: Path, env: dict | None = None, prefix: str = "") -> dict[str, list]:
    """Run the trainer on one GPU (torchrun -m lmyard.dispatch train) in `work`, with `env` added to its environment,
    its output on stderr (each line after `prefix`); its logged losses, {"val": [(step, loss)], "train": [...]},
    and its warnings ("warnings": [text])."""
    spec = work / "spec.json"
    spec.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "shards": shards, "lineage": None}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "lmyard.dispatch",
        "train",
        "--spec",
        str(spec),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "LMYARD_CACHE": str(work / "cache"),
        **(env or {}),
    }
    losses: dict[str, list] = {"val": [], "train": [], "warnings": []}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO) as proc:
        for line in proc.stdout:
            print(prefix + line, end="", file=sys.stderr, flush=True)
            if m := VAL_LINE.search(line):
                losses["val"].append((int(m.group(1)), float(m.group(2))))
            elif m := TRAIN_LINE.search(line):
                losses["train"].append((int(m.group(1)), float(m.group(2))))
            elif "UserWarning: " in line:
                losses["warnings"].append(line.split("UserWarning: ", 1)[1].strip())
    if proc.returncode:
        raise SystemExit(f"the trainer in {work} failed with exit code {proc.returncode}")
    return losses


def corpus_shards(cfg, work: Path) -> tuple[dict, dict]:
    """The tokenize-and-shard stage on cfg's source (the corpus written by write_corpus): (shard set as a dict,
    a report of it)."""
    from lmyard.data.sharding import tokenize_and_shard

    t0 = time.perf_counter()
    shards, _ = tokenize_and_shard(
        cfg, log=lambda s: print(s, file=sys.stderr, flush=True), cache_dir=str(work / "cache")
    )
    report = {
        "address": shards.address,
        "tokens": shards.manifest["tokens"],
        "seconds": round(time.perf_counter() - t0, 1),
        "epochs_planned": round(cfg.train.max_steps * cfg.train.batch_tokens / shards.tokens("train"), 2),
    }
    return shards.to_dict(), report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-shuffle", action="store_true", help="both shuffles off: the run of the issue")
    p.add_argument("--shard-only", action="store_true", help="write the corpus and the shards, do not train")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tmp", default=None, help="work folder (default: a new temporary one, kept)")
    a = p.parse_args()
    work = Path(a.tmp or tempfile.mkdtemp(prefix="lmyard-pylib-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "pylib.jsonl"
    report: dict = {"corpus": write_corpus(corpus)}
    shuffle = "false" if a.no_shuffle else "true"
    cfg = load_recipe(
        "smoke",
        [
            f"store={work / 'store'}",
            f"run_name=pylib-{'plain' if a.no_shuffle else 'shuffled'}",
            f"data.source={corpus}",
            *(f"{k}={v}" for k, v in TRAIN.items()),
            f"data.shuffle_documents={shuffle}",
            f"data.shuffle_sequences={shuffle}",
            *a.overrides,
        ],
    )
    shards, report["shards"] = corpus_shards(cfg, work)
    if not a.shard_only:
        evals = train(cfg, shards, work)["val"]
        report["val_loss"] = dict(evals)
        report["falls_at_every_evaluation"] = all(b < a for (_, a), (_, b) in zip(evals, evals[1:]))
    report["config"] = {
        "shuffle_documents": cfg.data.shuffle_documents,
        "shuffle_sequences": cfg.data.shuffle_sequences,
        **TRAIN,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
