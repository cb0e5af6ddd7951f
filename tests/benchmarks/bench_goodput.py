"""Goodput under preemption: a run SIGTERMed every few minutes and restarted as lmyard's retry restarts it.

    python tests/benchmarks/bench_goodput.py --minutes 30 --preempt-every 300 --checkpoint-every 500
    python tests/benchmarks/bench_goodput.py --device cpu --preset tiny --minutes 2 --preempt-every 30 \\
        --checkpoint-every 20 --tokens 1000000 --log-every 5 --set train.compile=false --set train.micro_batch=2 \\
        --set train.batch_tokens=128 --set model.block_size=64 --set model.n_layer=2 --set model.n_embd=64 \\
        --set model.n_head=2                                   # a dry run on a CPU machine (a tiny size)

It trains a recipe (`smoke` with `--preset`, default gpt2-124m on cuda) on memory-mapped shards of random
tokens for `--minutes`, through the launcher's own path: `lmyard.launch.local_job.LocalJob` runs
`torchrun -m lmyard.stages train --spec spec.json`, and every `--preempt-every` seconds after an attempt's launch
it gets SIGTERM, as a cancellation or a spot reclaim sends it (to torchrun and every rank). The trainer then
checkpoints the step it stopped at and ends as preempted; the same spec is launched again at once and resumes
from the store's newest committed checkpoint, exactly as lmyard's retry of the train stage does. At the end of
the window the last attempt gets SIGTERM too, and its committed step is the run's result.

Inductor's and Triton's caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and lmyard's own node-local cache
(LMYARD_CACHE) lie under one folder (`--cache`, else $LMYARD_CACHE, else the run's temporary folder) that every
attempt shares: a restart reuses the compiled kernels of the first attempt. `--earlier-lineage N` first trains N
steps of another lineage of the same config in the same store, outside the window, on a node whose caches are then
removed: the window's first start finds the store's compiled code, as a scheduled retraining's does.

It reports, as JSON (`summary {...}`) and a table:
- goodput: time in the steps that count / wall-clock, from the first launch to the last attempt's exit. The steps
  that count are those whose results survive to the end: 1 .. the last committed step, each once (a step run
  again after a restart counts once); their time is their number times the median steady step time (the
  trainer's `ms/step` windows, each attempt's first window left out: it holds the startup);
- per attempt: the step it resumed from, the step it stopped at, and the restart to its first step's end in
  parts (the trainer's `startup to the end of step N: ...` line: launch, rendezvous, resume, compile, first step,
  other; lmyard.train.components.Startup);
- steps lost per preemption: the steps an attempt ran beyond the one the next attempt resumed from (lmyard
  commits the step it stopped at on SIGTERM, so 0 unless a commit missed `launch.grace_s`).

Needs only what the trainer needs (torch, numpy, pydantic, pyyaml, psutil; docs/performance.md says how those
travel to a GPU machine): no Prefect, MLflow (no lineage: the metrics go nowhere), boto3 or docker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from random_shards import make_shards  # noqa: E402

from lmyard.checkpoint.catalog import complete_steps  # noqa: E402
from lmyard.errors import Preempted  # noqa: E402
from lmyard.launch.follower import Follower  # noqa: E402
from lmyard.launch.local_job import LocalJob  # noqa: E402
from lmyard.recipes import load_recipe  # noqa: E402
from lmyard.run import Run  # noqa: E402
from lmyard.store import open_store  # noqa: E402

RUN = "goodput"
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| .* \| ([\d.]+) ms/step \|")
STARTUP_LINE = re.compile(r"^startup to the end of step (\d+): ([\d.]+) s = (.*)")
PART = re.compile(r"([a-z][a-z ]*?) ([\d.]+) s(?: \+ |$| \()")  # any part the trainer names (its names changed)
STOPPED = re.compile(r"stopped by SIGTERM after step (\d+)")
# a 64 GiB disk holds llama-1b's checkpoints (15 GB each) only with these (lmyard.checkpoint.budget says how many)
LLAMA_1B_DISK = ["checkpoint.keep_last=2", "checkpoint.keep_best=false", "checkpoint.max_pending=1"]


def config(a: argparse.Namespace, work: Path, *, run: str = RUN, max_steps: int = 100000000, log_every: int = 0,
           checkpoint_every: int = 0):  # fmt: skip
    """The benchmark's run: the window ends it, not the step count (unless `max_steps`); no in-loop evaluation."""
    return load_recipe(
        a.recipe,
        [
            f"store={work / 'store'}",
            f"run_name={run}",
            f"model.preset={a.preset}",
            f"train.device={a.device}",
            f"train.max_steps={max_steps}",
            f"train.log_interval={log_every or a.log_every}",
            f"checkpoint.interval={checkpoint_every or a.checkpoint_every}",
            "eval.interval=100000000",
            f"launch.nproc_per_node={a.nproc}",
            *(LLAMA_1B_DISK if a.preset == "llama-1b" else []),
            *a.overrides,
        ],
    )


def use_caches(a: argparse.Namespace, work: Path, attempt: int = 1) -> dict[str, str]:
    """One node-local folder for lmyard's cache and inductor's and Triton's, shared by every attempt; with
    `--fresh-node` each attempt gets a new empty one (`node<N>`, the one before removed): only the run's store
    carries what travels to a restart (checkpoints, compiled code)."""
    base = Path(a.cache or os.environ.get("LMYARD_CACHE") or work / "cache")
    root = base
    if a.fresh_node:
        import shutil

        shutil.rmtree(base / f"node{attempt - 1}", ignore_errors=True)
        root = base / f"node{attempt}"
    caches = {
        "LMYARD_CACHE": str(root),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    for path in caches.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    os.environ.update(caches)  # the launcher passes its environment to torchrun and the ranks
    return caches


class Attempt:
    """One launch of the train stage: its lines read as they come, SIGTERM at `stop_at` (monotonic seconds)."""

    def __init__(self, n: int, cfg, spec: dict, stop_at: float, echo: bool):
        from lmyard.stages import TrainSpec

        self.n, self.cfg, self.echo, self.stop_at = n, cfg, echo, stop_at
        self.job = LocalJob(cfg, TrainSpec.model_validate(spec))
        self.start_step: int | None = None
        self.stopped_at: int | None = None
        self.startup: dict[str, float] = {}
        self.step_ms: list[float] = []
        self.ended = ""
        self.last_line_at = time.monotonic()
        self.end_s: float | None = None  # from its last line to its process's exit: the ranks' and torchrun's end

    def on_line(self, line: str) -> None:
        self.last_line_at = time.monotonic()
        if self.echo:
            print(f"[attempt {self.n}] {line}", flush=True)
        if m := STEP_LINE.match(line):
            self.step_ms.append(float(m.group(2)))
        elif m := STARTUP_LINE.match(line):
            self.startup = {k.replace(" ", "_"): float(v) for k, v in PART.findall(m.group(3))}
            self.startup["total"] = float(m.group(2))

    def run(self) -> float:
        """Runs to its end; the seconds it took."""
        t0 = time.monotonic()
        done = threading.Event()

        def preempt() -> None:
            if not done.wait(max(0.0, self.stop_at - time.monotonic())):
                self.job.terminate()  # SIGTERM to torchrun and every rank, as a cancellation sends it

        threading.Thread(target=preempt, daemon=True).start()
        try:
            Follower(self.job, self.cfg, self.on_line, on_started=self._started).run()
            self.ended = "finished"
        except Preempted as e:
            self.ended = "preempted"
            if m := STOPPED.search(str(e)):
                self.stopped_at = int(m.group(1))
        except Exception as e:  # a SIGTERM before the trainer's handler was in place: the attempt just failed
            self.ended = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            done.set()
            self.end_s = round(time.monotonic() - self.last_line_at, 2)
        return time.monotonic() - t0

    def _started(self, started) -> None:
        self.start_step = started.start_step

    def row(self) -> dict:
        return {
            "attempt": self.n,
            "start_step": self.start_step,
            "stopped_at": self.stopped_at,
            "ended": self.ended,
            "end_s": self.end_s,
            "startup_s": self.startup,
        }


def run(a: argparse.Namespace, work: Path) -> dict:
    cfg = config(a, work)
    caches: dict[str, str] = {}
    shards = make_shards(work / "store", a.tokens, a.tokenizer)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards, "lineage": None}
    earlier = earlier_lineage(a, work, spec) if a.earlier_lineage else None
    attempts: list[Attempt] = []
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60
    while not attempts or time.monotonic() < deadline - a.min_attempt:
        caches = use_caches(a, work, len(attempts) + 1)
        attempt = Attempt(len(attempts) + 1, cfg, spec, min(time.monotonic() + a.preempt_every, deadline), a.echo)
        attempts.append(attempt)
        took = attempt.run()
        print(f"attempt {attempt.n}: {attempt.ended} after {took:.1f} s, at step {attempt.stopped_at}", flush=True)
        if attempt.ended.startswith("failed: UserError"):  # the config cannot run: no retry runs it either
            raise SystemExit(f"attempt {attempt.n} {attempt.ended}")
    wall = time.monotonic() - t0
    committed = complete_steps(Run(RUN, open_store(cfg.store)))
    return {**summarize(a, cfg, attempts, committed[-1] if committed else 0, wall, caches), "earlier_lineage": earlier}


def earlier_lineage(a: argparse.Namespace, work: Path, spec: dict) -> dict:
    """Before the window: another lineage of the same config in the same store (a scheduled retraining's run
    before), `--earlier-lineage` steps on a node of its own, whose caches are then removed: the window's first
    attempt finds only what the store carries (the compiled code, `train.compile_cache`), not its checkpoints."""
    import shutil

    node, names = work / "earlier-node", ("LMYARD_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    before = {name: os.environ.get(name) for name in names}
    for name, sub in zip(names, ("", "inductor", "triton")):
        (node / sub).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(node / sub)
    cfg = config(a, work, run=f"{RUN}-earlier", max_steps=a.earlier_lineage, checkpoint_every=a.earlier_lineage)
    attempt = Attempt(0, cfg, {**spec, "config": cfg.model_dump(mode="json")}, time.monotonic() + 1e9, a.echo)
    took = attempt.run()
    print(f"earlier lineage: {attempt.ended} after {took:.1f} s (not in the window)", flush=True)
    shutil.rmtree(node, ignore_errors=True)
    for name, value in before.items():  # the window's caches are its own (use_caches)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return {"steps": a.earlier_lineage, "ended": attempt.ended, "seconds": round(took, 1)}


def summarize(a: argparse.Namespace, cfg, attempts: list[Attempt], final_step: int, wall: float, caches) -> dict:
    step_s = steady_step_s(attempts)
    rows = [at.row() for at in attempts]
    for i, row in enumerate(rows):
        # the step the next attempt that got as far as resuming resumed from (an attempt stopped before its
        # trainer took SIGTERM over ran no step), else the run's last committed step
        resumed = next((r["start_step"] for r in rows[i + 1 :] if r["start_step"] is not None), final_step)
        row["steps_lost"] = None if row["stopped_at"] is None else row["stopped_at"] - resumed
    lost = [r["steps_lost"] for r in rows[:-1] if r["stopped_at"] is not None]
    return {
        "recipe": a.recipe,
        "preset": a.preset,
        "device": a.device,
        "nproc": a.nproc,
        "minutes": a.minutes,
        "preempt_every_s": a.preempt_every,
        "checkpoint_every": a.checkpoint_every,
        "batch_tokens": cfg.train.batch_tokens,
        "overrides": a.overrides,
        "fresh_node": a.fresh_node,
        "caches": caches,
        "wall_s": round(wall, 1),
        "steps_that_count": final_step,
        "steady_step_s": round(step_s, 4),
        "goodput": round(final_step * step_s / wall, 4),
        "preemptions": len(attempts) - 1,
        "attempts_stopped_before_their_first_step": sum(1 for at in attempts if not at.startup),
        "steps_lost_per_preemption": lost,
        "attempts": rows,
    }


def steady_step_s(attempts: list[Attempt]) -> float:
    """The median of the step-time windows after each attempt's first (which holds its startup); without any,
    the median of the attempts' `first step` parts (their second step's time)."""
    windows = [ms / 1000 for at in attempts for ms in at.step_ms[1:]]
    seconds = windows or [at.startup["first_step"] for at in attempts if "first_step" in at.startup]
    return statistics.median(seconds) if seconds else float("nan")


def table(summary: dict) -> str:
    names = list(dict.fromkeys(k for r in summary["attempts"] for k in r["startup_s"] if k != "total"))
    head = ["attempt", "resumed at", "stopped at", "lost", *(n.replace("_", " ") for n in names), "total"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for r in summary["attempts"]:
        s = r["startup_s"]
        parts = [f"{s[p]:.2f}" if p in s else "" for p in (*names, "total")]
        cells = [r["attempt"], r["start_step"], r["stopped_at"], r["steps_lost"], *parts]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="the window, from the first launch")
    ap.add_argument("--preempt-every", type=float, default=300.0, help="SIGTERM this long after each launch (s)")
    ap.add_argument("--checkpoint-every", type=int, default=500, help="checkpoint.interval (steps)")
    ap.add_argument("--recipe", default="smoke")
    ap.add_argument("--preset", default="gpt2-124m", help="model.preset (tiny on a CPU)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) on this machine")
    ap.add_argument("--log-every", type=int, default=10, help="train.log_interval: the step-time windows")
    ap.add_argument(
        "--tokenizer", default="r50k_base", choices=["r50k_base", "bytes"], help="the random ids' vocabulary"
    )
    ap.add_argument("--tokens", type=int, default=64 << 20, help="random tokens in the train split")
    ap.add_argument("--cache", help="node-local cache folder for lmyard, inductor and Triton (default $LMYARD_CACHE)")
    ap.add_argument(
        "--fresh-node",
        action="store_true",
        help="every attempt starts with empty lmyard, inductor and Triton caches, as on another node",
    )
    ap.add_argument(
        "--earlier-lineage",
        type=int,
        default=0,
        help="first train another lineage of the same config in the store for this many steps, on a node of its "
        "own (outside the window): the window's first start finds its compiled code in the store",
    )
    ap.add_argument("--min-attempt", type=float, default=10.0, help="no new attempt this close to the window's end")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--echo", action="store_true", help="print the trainer's lines")
    a = ap.parse_args()
    if a.earlier_lineage < 0:
        ap.error(f"--earlier-lineage {a.earlier_lineage}: give the earlier lineage's steps (0: none)")
    with tempfile.TemporaryDirectory(prefix="lmyard-goodput-") as tmp:
        summary = run(a, Path(tmp))
    if summary["earlier_lineage"]:
        print(f"before the window, another lineage in the same store: {summary['earlier_lineage']}")
    print(
        "every attempt with empty caches, as on a fresh node (compiled code only from the store)"
        if summary["fresh_node"]
        else f"inductor and Triton caches shared by every attempt: {summary['caches']['TORCHINDUCTOR_CACHE_DIR']}"
    )
    print(table(summary))
    print(
        f"goodput {summary['goodput']:.1%}: {summary['steps_that_count']} steps that count x "
        f"{summary['steady_step_s'] * 1000:.1f} ms / {summary['wall_s']:.0f} s wall-clock, "
        f"{summary['preemptions']} preemptions, steps lost {summary['steps_lost_per_preemption']}"
    )
    print("summary " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
