"""Benchmark of the tokenize-and-shard stage; prints JSON figures.

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_shard.py [--num-proc N] [--sizes-mb 1000 4000]
        [--set data.shuffle_documents=true ...]

For each corpus size it writes a JSONL corpus (CPython's bundled documentation,
replicated with a per-copy prefix; no network) as --files files to a temporary folder, runs the
whole stage (`tokenize_and_shard`: fingerprint, read tasks, tokenize on N
processes, write shards to a local store) in a child process, and samples the
resident memory of that child and its tokenizer processes every 20 ms. Then it
times raw tiktoken `encode_ordinary_batch(texts, num_threads=N)` on the same
texts in this process (16,384 documents a call; JSON parsing outside the timed
calls). Everything it writes is removed at the end.

It needs no GPU and imports only numpy, tiktoken, psutil and what the stage
imports for a local JSONL source (pydantic, pyyaml): no datasets, torch, boto3,
prefect or mlflow. On a machine without them:
    pip install --no-index --find-links .whl/bench-py312 pydantic pyyaml psutil
(.whl/bench-py312 holds the CPython 3.12 x86-64 wheels and tiktoken's GPT-2
ranks under tiktoken/, for TIKTOKEN_CACHE_DIR; see docs/performance.md).

Figures:
- stage_vs_raw: stage tokens/s over raw tokens/s, same text, same N (target >= 0.9)
- stage_vs_raw_cpu: raw CPU seconds over the stage's (all its processes): the
  work per token, which other load on a shared machine disturbs less than time
- peak_rss_mb of the stage per corpus size: all its processes together, and
  the main process alone (target: the sizes within 20% of each other)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

_STAGE = textwrap.dedent("""
    import json, sys, time
    from lmyard.recipes import load_recipe
    from lmyard.data.sharding import tokenize_and_shard

    cfg = load_recipe("smoke", sys.argv[2:])
    t0 = time.perf_counter()
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None, cache_dir=sys.argv[1])
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "main_cpu_seconds": round(time.process_time(), 2),
                      "documents": shards.manifest["documents"],
                      "tokens": sum(shards.manifest["tokens"].values()), "shards": len(shards.manifest["shards"])}))
""")


def write_corpus(folder: Path, target_bytes: int, files: int) -> int:
    """A JSONL corpus of about target_bytes in `files` files: pydoc topics, each copy made distinct by a prefix."""
    from pydoc_data.topics import topics

    bodies = [json.dumps(topics[k])[1:-1] for k in sorted(topics)]  # JSON-escaped once
    folder.mkdir()
    written, copy = 0, 0
    for i in range(files):
        with open(folder / f"part-{i:04d}.jsonl", "w", encoding="utf-8", buffering=1 << 22) as f:
            while written < target_bytes * (i + 1) / files:
                block = "".join(f'{{"text": "Copy {copy} of the Python reference.\\n\\n{b}"}}\n' for b in bodies)
                f.write(block)
                written += len(block.encode())
                copy += 1
    return written


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of the process and all its children, RSS of the process alone), bytes."""
    try:
        own = proc.memory_info().rss
        kids = 0
        for c in proc.children(recursive=True):
            try:
                kids += c.memory_info().rss
            except psutil.Error:
                pass
        return own + kids, own
    except psutil.Error:
        return 0, 0


def run_stage(corpus: Path, work: Path, num_proc: int, overrides: list[str]) -> dict:
    store, cache = work / "store", work / "cache"
    args = [
        f"store={store}",
        f"data.source={corpus}/*.jsonl",
        "tokenizer.name=gpt2",
        f"data.num_proc={num_proc}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the stage and its tokenizer processes, once reaped
    proc = subprocess.Popen(
        [sys.executable, "-c", _STAGE, str(cache), *args], env=env, stdout=subprocess.PIPE, text=True
    )
    ps = psutil.Process(proc.pid)
    peak = {"tree": 0, "main": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            tree, own = tree_rss(ps)
            peak["tree"], peak["main"] = max(peak["tree"], tree), max(peak["main"], own)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"stage failed with exit code {proc.returncode}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result = {**json.loads(out.strip().splitlines()[-1]), "cpu_seconds": round(cpu, 2)}
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {**result, "peak_rss_mb": round(peak["tree"] / 2**20, 1), "peak_rss_main_mb": round(peak["main"] / 2**20, 1)}


def raw_tiktoken(corpus: Path, num_proc: int, chunk_docs: int = 16384) -> dict:
    """encode_ordinary_batch on the corpus's texts, 16,384 documents a call; only the calls are timed.

    Chunks keep the token lists of a 1 GB corpus (~10 GB as Python ints) out of memory.
    """
    import tiktoken

    enc = tiktoken.get_encoding("r50k_base")
    seconds, cpu, docs, tokens = 0.0, 0.0, 0, 0
    for path in sorted(corpus.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            while texts := [json.loads(line)["text"] for _, line in zip(range(chunk_docs), f)]:
                t0, c0 = time.perf_counter(), time.process_time()
                ids = enc.encode_ordinary_batch(texts, num_threads=num_proc)
                seconds, cpu = seconds + time.perf_counter() - t0, cpu + time.process_time() - c0
                docs, tokens = docs + len(texts), tokens + sum(map(len, ids))
    return {"seconds": seconds, "cpu_seconds": round(cpu, 2), "documents": docs, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[1000, 4000])
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the stage, e.g. data.shuffle_documents=true (repeatable)",
    )
    p.add_argument("--no-raw", action="store_true", help="skip the raw tiktoken baseline")
    p.add_argument("--files", type=int, default=8, help="JSONL files the corpus is written as (default 8)")
    p.add_argument("--tmp", default=None, help="folder for the corpus and the store (default: the system's)")
    a = p.parse_args()

    report: dict = {
        "num_proc": a.num_proc,
        "cpus": os.cpu_count(),
        "tokenizer": "r50k_base (gpt2)",
        "overrides": a.overrides,
        "python": sys.version.split()[0],
        "sizes": [],
    }
    with tempfile.TemporaryDirectory(prefix="lmyard-bench-", dir=a.tmp) as tmp:
        work = Path(tmp)
        for mb in a.sizes_mb:
            corpus = work / f"corpus-{mb}mb"
            size = write_corpus(corpus, mb * 10**6, a.files)
            entry: dict = {"corpus_mb": round(size / 1e6, 1), "files": a.files}
            stage = run_stage(corpus, work, a.num_proc, a.overrides)
            text_tokens = stage["tokens"] - stage["documents"]  # the stage adds one <|endoftext|> per document
            entry["stage"] = {**stage, "tokens_per_s": round(text_tokens / stage["seconds"])}
            if not a.no_raw:
                raw = raw_tiktoken(corpus, a.num_proc)
                assert raw["tokens"] == text_tokens, (raw["tokens"], text_tokens)
                entry["raw_tiktoken"] = {**raw, "tokens_per_s": round(raw["tokens"] / raw["seconds"])}
                entry["stage_vs_raw"] = round(raw["seconds"] / stage["seconds"], 3)
                entry["stage_vs_raw_cpu"] = round(raw["cpu_seconds"] / stage["cpu_seconds"], 3)  # CPU work per token
            shutil.rmtree(corpus)
            report["sizes"].append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
    rss = [s["stage"]["peak_rss_mb"] for s in report["sizes"]]
    report["peak_rss_max_over_min"] = round(max(rss) / min(rss), 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
