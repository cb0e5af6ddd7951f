"""Where a restart's seconds go: a cold start, restarts on the same node (a fresh interpreter, a warm standby), one
on a fresh node, in parts.

    python tests/benchmarks/bench_restart.py --set train.batch_tokens=65536 --set train.micro_batch=32 \\
        --out restart.json                                     # GPT-2 124M on one GPU, ~3 min
    python tests/benchmarks/bench_restart.py --device cpu --preset tiny --steps 4 --tokens 200000 \\
        --tokenizer bytes --set train.compile=false --set train.micro_batch=2 --set train.batch_tokens=128 \\
        --set model.block_size=64 --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=2   # a CPU dry run

Four launches of the train stage through the launcher's own path (lmyard.launch.local_job.LocalJob: torchrun)
on memory-mapped shards of random tokens, each to its `train.max_steps`:

1. cold: empty lmyard, inductor and Triton caches, no checkpoint: `--steps` steps, a checkpoint at the last;
2. restart: the same node's caches, resumed from that checkpoint, `--steps` more, launch.standby=false;
3. restart, warm standby: the same, its torchrun and ranks in the standbys launch 1 started (waited for until warm);
4. fresh node: new empty caches, resumed from the newest checkpoint: only the run's store carries anything.

For each it prints the trainer's own parts (lmyard.train.components.Startup, its `startup to the end of step N`
line: whatever parts the code names, so the same command measures the code before and after a change) and two
this script measures from outside, so an older trainer's single `launch` part is split too: `torchrun (outside)`,
the launch to the rank's process start (psutil), and `imports (outside)`, the rest of the trainer's launch part.
Then `python -X importtime` of what a rank imports before its first line (lmyard.stages and the train stage) and
of torchrun's agent: the total and the modules that cost most. It ends with `summary {json}`.

Needs only what the trainer needs (torch, numpy, pydantic, pyyaml, psutil, tiktoken for r50k ids).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_goodput import Attempt  # noqa: E402
from bench_goodput import config as goodput_config  # noqa: E402
from random_shards import make_shards  # noqa: E402

from lmyard.launch import standby as standby_pool  # noqa: E402

RUN = "restart"
IMPORT_ROW = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)$")
RANK_IMPORTS = "import lmyard.stages.entry, lmyard.train.stage"
TORCHRUN_IMPORTS = "import lmyard.launch.torchrun, torch.distributed.run"


def config(a: argparse.Namespace, work: Path, steps: int):
    return goodput_config(a, work, run=RUN, max_steps=steps, log_every=a.steps, checkpoint_every=a.steps)


def use_caches(root: Path) -> None:
    for name, sub in (("LMYARD_CACHE", ""), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        path = root / sub if sub else root
        path.mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(path)  # the launcher passes its environment to torchrun and the ranks


def rank_start(launched: float, found: dict, done: threading.Event) -> None:
    """Seconds from `launched` to the start of the first rank process (the train stage under torchrun)."""
    import psutil

    me = psutil.Process()
    while not done.wait(0.05):
        for p in me.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())  # a rank: the train stage, or the process a standby takes it from
                if (
                    "lmyard.stages" in cmd or "lmyard.launch.standby train" in cmd
                ) and "TORCHELASTIC_RUN_ID" in p.environ():
                    found["torchrun_outside"] = max(0.0, p.create_time() - launched)
                    return
            except psutil.Error:
                continue


def launch(n: int, name: str, a: argparse.Namespace, work: Path, spec: dict, steps: int, standby: bool) -> dict:
    cfg = config(a, work, steps)
    cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"standby": standby})})
    spec = {**spec, "config": cfg.model_dump(mode="json")}
    attempt = Attempt(n, cfg, spec, time.monotonic() + 1e9, a.echo)
    cache_lines: list[str] = []
    on_line = attempt.on_line

    def keep(line: str) -> None:
        if line.startswith("compile cache:"):
            cache_lines.append(line)
        on_line(line)

    attempt.on_line = keep  # type: ignore[method-assign]
    found: dict[str, float] = {}
    done = threading.Event()
    watcher = threading.Thread(target=rank_start, args=(time.time(), found, done), daemon=True)
    watcher.start()
    took = attempt.run()
    done.set()
    parts = dict(attempt.startup)
    if "torchrun_outside" in found:
        found["imports_outside"] = max(
            0.0, parts.get("launch", parts.get("torchrun", 0) + parts.get("imports", 0)) - found["torchrun_outside"]
        )
    print(f"{name}: {attempt.ended} after {took:.1f} s (its last line to its exit: {attempt.end_s} s); "
          f"{cache_lines[-1] if cache_lines else ''}", flush=True)  # fmt: skip
    return {
        "launch": name,
        "ended": attempt.ended,
        "seconds": round(took, 2),
        "end_s": attempt.end_s,
        "parts_s": parts,
        **found,
        "compile_cache": cache_lines,
    }


def wait_warm(n: int, timeout_s: float = 300.0) -> float:
    """Seconds waited until `n` standbys are warm (a preemption minutes into a run finds them so)."""
    t0 = time.monotonic()
    folder = standby_pool.pool().folder
    while len(list(Path(folder).glob("*.sock"))) < n and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
    return round(time.monotonic() - t0, 2)


def import_times(code: str, top: int) -> dict:
    """`python -X importtime -c code`, the second of two runs (the files cached): total and the costliest modules
    at the two outer levels."""
    rows: list[tuple[int, int, str]] = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=REPO, check=True
        ).stderr
        rows = []
        for line in out.splitlines():
            if m := IMPORT_ROW.match(line):
                rows.append((int(m.group(2)), (len(m.group(3)) - 1) // 2, m.group(4)))
    total = sum(c for c, depth, _ in rows if depth == 0)
    outer = sorted((r for r in rows if r[1] <= 1), reverse=True)[:top]
    return {
        "total_s": round(total / 1e6, 3),
        "top": [{"module": m, "s": round(c / 1e6, 3), "depth": d} for c, d, m in outer],
    }


def table(launches: list[dict]) -> str:
    names = list(dict.fromkeys(k for r in launches for k in r["parts_s"] if k != "total"))
    outside = ["torchrun_outside", "imports_outside", "end_s"]  # end_s: the attempt's last line to its exit
    head = ["part", *(r["launch"] for r in launches)]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(launches)]
    for name in [*names, "total", *outside]:
        cells = [r["parts_s"].get(name, r.get(name)) for r in launches]
        lines.append(
            f"| {'end (last line to exit)' if name == 'end_s' else name.replace('_', ' ')} | "
            + " | ".join("" if c is None else f"{c:.2f}" for c in cells)
            + " |"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace, work: Path) -> dict:
    shards = make_shards(work / "store", a.tokens, a.tokenizer)
    spec = {"shards": shards, "lineage": None}
    use_caches(work / "node1")
    launches = [launch(1, "cold", a, work, spec, a.steps, standby=True)]  # its standbys warm up meanwhile
    if launches[0]["ended"] != "finished":  # nothing to restart from; its standbys would wait for no one
        standby_pool.close()
        raise SystemExit(f"the cold launch {launches[0]['ended']}")
    launches.append(launch(2, "restart", a, work, spec, 2 * a.steps, standby=False))
    warm_s = wait_warm(a.nproc + 1)  # torchrun's and each rank's
    launches.append(launch(3, "restart, warm standby", a, work, spec, 3 * a.steps, standby=True))
    shutil.rmtree(work / "node1", ignore_errors=True)
    use_caches(work / "node2")  # another environment: the standbys refuse it, as they would not be there
    launches.append(launch(4, "fresh node", a, work, spec, 4 * a.steps, standby=True))
    standby_pool.close()
    return {
        "preset": a.preset,
        "device": a.device,
        "nproc": a.nproc,
        "steps_per_launch": a.steps,
        "overrides": a.overrides,
        "launches": launches,
        "standby_warm_wait_s": warm_s,
        "imports_rank": import_times(RANK_IMPORTS, a.top),
        "imports_torchrun": import_times(TORCHRUN_IMPORTS, a.top),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smoke")
    ap.add_argument("--preset", default="gpt2-124m", help="model.preset (tiny on a CPU)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) on this machine")
    ap.add_argument("--steps", type=int, default=20, help="steps of each launch (a checkpoint at its end)")
    ap.add_argument("--tokens", type=int, default=16 << 20, help="random tokens in the train split")
    ap.add_argument("--tokenizer", default="r50k_base", choices=["r50k_base", "bytes"])
    ap.add_argument("--top", type=int, default=12, help="modules listed from -X importtime")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--out", help="also write the summary JSON here")
    ap.add_argument("--echo", action="store_true", help="print the trainer's lines")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmyard-restart-") as tmp:
        summary = run(a, Path(tmp))
    print(table(summary["launches"]))
    for who in ("rank", "torchrun"):
        imp = summary[f"imports_{who}"]
        top = ", ".join(f"{t['module']} {t['s']:.2f}" for t in imp["top"])
        print(f"imports of a {who} (python -X importtime): {imp['total_s']:.2f} s; costliest: {top}")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))
    print("summary " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
