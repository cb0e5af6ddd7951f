"""Benchmark of tokenize-and-shard on a Ray cluster of 1, 2 and 4 nodes, beside raw tiktoken; prints a table.

    TIKTOKEN_CACHE_DIR=... python tests/benchmarks/bench_ray_shard.py [--corpus-mb 200] [--nodes 1 2 4]
        [--cpus-per-node C] [--files 16]

It writes a JSONL corpus of --corpus-mb MB (CPython's bundled documentation, replicated with a per-copy
prefix; no network) to a temporary folder. For each node count n it starts a local Ray cluster
(ray.cluster_utils.Cluster, bound to 127.0.0.1) of n nodes of C CPUs each (default: this machine's cores
over the largest n), runs the shard stage through the launcher with launch.backend=ray (the stage's
coordinator on one node, its read pieces, ~1 MiB of JSONL each, as Ray tasks over every node;
lmyard.data.raypool) into a fresh local store, and stops the cluster. Then it times raw tiktoken in
C * n processes on the same texts (`encode_ordinary_batch` of 512 documents a call in each), for every
n. Every run gives the same shard set (the address is checked). Everything it writes is removed at the end.

Columns: nodes, CPUs in all, the stage's seconds (manifest `created_s`: fingerprint to manifest) and
the launch's (actor and Ray workers started, cleanup), stage tokens/s, raw tiktoken tokens/s in as
many processes, and their ratio. The nodes of a local cluster share this machine's cores: the rows
scale while n * C <= its cores.

It imports numpy, tiktoken, ray, and what the stage imports for a local JSONL source (pydantic,
pyyaml, psutil): no torch, datasets, boto3, prefect or mlflow (docs/benchmarks.md says how the
wheels travel).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_shard import write_corpus  # noqa: E402  (the corpus bench_shard.py measures: pydoc topics)

# the Ray workers and the stage process import lmyard from this checkout too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def texts_of(folder: Path) -> list[str]:
    out: list[str] = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line)["text"] for line in f)
    return out


def on_cluster(nodes: int, cpus: int, corpus: Path, store: Path) -> dict:
    """The shard stage through the launcher on a fresh local cluster of `nodes` x `cpus`."""
    import ray
    from ray.cluster_utils import Cluster

    from lmyard.launch.launcher import launch
    from lmyard.recipes import load_recipe
    from lmyard.stages import ShardSpec

    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # 127.0.0.1 here and in every Ray process
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        sets = [
            f"store={store}",
            f"data.source={corpus}/*.jsonl",
            "tokenizer.name=gpt2",
            "launch.backend=ray",
            f"launch.ray.address={cluster.address}",
        ]
        t0 = time.perf_counter()
        result = launch(ShardSpec(config=load_recipe("smoke", sets)), on_line=lambda s: None)
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    manifest = result.shards.manifest
    tokens = sum(manifest["tokens"].values())
    return {
        "address": result.shards.address,
        "stage_s": manifest["created_s"],
        "launch_s": round(wall, 2),
        "tokens": tokens,
        "pieces": len(result.ray_nodes),
        "nodes_used": len(set(result.ray_nodes)),
    }


_texts: list[str] = []  # the corpus's texts, inherited by raw_tiktoken's forked processes
_enc = None


def _raw_init() -> None:
    global _enc
    import tiktoken

    _enc = tiktoken.get_encoding("r50k_base")
    _enc.encode_ordinary("warm")


def _raw_count(span: tuple[int, int]) -> int:
    assert _enc is not None, "_raw_init ran in this process"
    return sum(len(x) for x in _enc.encode_ordinary_batch(_texts[span[0] : span[1]], num_threads=1))


def raw_tiktoken(texts: list[str], procs: int, chunk: int = 512) -> float:
    """Tokens/s of tiktoken in `procs` processes (each one a thread) over the texts, `chunk` documents a
    call, as the stage's pieces run: processes, not threads (tiktoken's threads share one interpreter and
    stop scaling at a few). Only the encoding is timed: the processes are started and warm before."""
    import multiprocessing

    global _texts
    _texts = texts
    spans = [(i, min(i + chunk, len(texts))) for i in range(0, len(texts), chunk)]
    with multiprocessing.get_context("fork").Pool(procs, initializer=_raw_init) as pool:
        pool.map(_raw_count, [(0, 1)] * procs)
        t0 = time.perf_counter()
        tokens = sum(pool.imap_unordered(_raw_count, spans))
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=200)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cpus-per-node", type=int, default=None, help="default: cores // max(--nodes)")
    p.add_argument("--files", type=int, default=16)
    args = p.parse_args()
    cpus = args.cpus_per_node or max(1, (os.cpu_count() or 1) // max(args.nodes))
    work = Path(tempfile.mkdtemp(prefix="bench-ray-shard-"))
    os.environ.setdefault("LMYARD_CACHE", str(work / "cache"))
    try:
        corpus = work / "corpus"
        write_corpus(corpus, int(args.corpus_mb * 1e6), args.files)
        texts = texts_of(corpus)
        rows, addresses = [], set()
        for n in args.nodes:
            r = on_cluster(n, cpus, corpus, work / f"store-{n}")
            addresses.add(r["address"])
            raw = raw_tiktoken(texts, n * cpus)
            rows.append({**r, "nodes": n, "cpus": n * cpus, "raw_tok_s": raw, "tok_s": r["tokens"] / r["stage_s"]})
        assert len(addresses) == 1, f"the node counts gave different shard sets: {addresses}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus {args.corpus_mb:g} MB, {rows[0]['tokens']:,} tokens, {rows[0]['pieces']} pieces; {cpus} CPUs a node")
    print(
        f"{'nodes':>5} {'CPUs':>5} {'used':>5} {'stage s':>8} {'launch s':>9} {'stage tok/s':>12} "
        f"{'raw tok/s':>12} {'stage/raw':>9}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>5} {r['cpus']:>5} {r['nodes_used']:>5} {r['stage_s']:>8.2f} {r['launch_s']:>9.2f} "
            f"{r['tok_s']:>12,.0f} {r['raw_tok_s']:>12,.0f} {r['tok_s'] / r['raw_tok_s']:>9.2f}"
        )


if __name__ == "__main__":
    main()
