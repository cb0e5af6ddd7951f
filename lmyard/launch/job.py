"""What every backend's job is and the command it runs on each node.

`Job` (one launch of a stage on its nodes: start, read, terminate, kill, close) and `JobFactory` (how the backend
table, lmyard.backends, names what makes one); `stage_command` (torchrun for training, `torchrun_command`, one
process for the other stages) and `stage_env`, the environment every launch gives it.

Design notes: docs/launch.md, `lmyard/launch/job.py`.
"""

from __future__ import annotations

import os
import queue
import sys
from collections.abc import Callable
from typing import Protocol

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.stages import StageSpec, TrainSpec

RDZV_TIMEOUT_S = 600  # how long node 0 waits for the others to join


class Job(Protocol):
    """One launch of a stage on `nodes` nodes."""

    nodes: int
    spec: StageSpec

    def start(self, events: queue.Queue) -> None:
        """Start every node; then put ("line", node, text), ("exit", node, code), ("error", node, exc) on `events`."""

    def read(self, name: str) -> bytes | None:
        """A file of the exchange folder of the node that runs rank 0 (node 0 of a local or Docker job), or None."""

    def read_all(self, folder: str) -> dict[str, bytes]:
        """The files of a subfolder of every node's exchange folder, by name."""

    def terminate(self) -> None:
        """SIGTERM to every node (the trainer checkpoints and exits as preempted)."""

    def kill(self) -> None: ...

    def why(self, node: int, code: int) -> str:
        """Words on an exit code: ` (out of memory)`, ` (killed)`, or ''."""

    def close(self) -> None:
        """Remove everything the job made; tolerates what is already gone."""


class JobFactory(Protocol):
    """How the launcher makes a backend's Job (named `module:name` in the backend table, lmyard.backends): the
    job of `spec`'s stage; `flow_run_id` labels what the job makes (None outside a flow)."""

    def __call__(
        self, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> Job: ...


def torchrun_command(
    cfg: RunConfig,
    *,
    python: str = sys.executable,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node: int | None = None,
    local_addr: str | None = None,
    spec_path: str | None = None,
    node_rank: str | None = None,
    standby: bool = False,
) -> list[str]:
    """torchrun running the trainer on one node: standalone for one node, else a c10d (or static) rendezvous.

    `node` (when the caller knows it) tells torchrun whether this node hosts the rendezvous. `node_rank` instead: a
    static rendezvous at the endpoint, this node's rank as given (a placeholder the node fills in: Kubernetes'
    `$(NODE_RANK)`, lmyard.launch.kubernetes); node 0 hosts it. `standby`: torchrun and its ranks start in this
    node's warm standbys, where there are (lmyard.launch.standby)."""
    n = cfg.launch.nnodes
    warm = ["lmyard.launch.standby", "--agent"] if standby else ["lmyard.launch.torchrun"]
    cmd = [
        python,
        "-m",
        *warm,  # torchrun: a preempted rank stops no other, a failed rank is one line
        "--nnodes",
        str(n),
        "--nproc_per_node",
        str(cfg.launch.nproc_per_node),
        "--max_restarts",
        "0",
    ]
    if n == 1:  # its own rendezvous; at `local_addr` where the host's name does not resolve (an elastic run's one)
        cmd += ["--standalone", *(["--local_addr", local_addr] if local_addr else [])]
    else:
        endpoint = rdzv_endpoint or cfg.launch.rdzv_endpoint
        if not endpoint:
            raise UserError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of node 0)")
        static = node_rank is not None
        cmd += ["--rdzv_backend", "static" if static else "c10d", "--rdzv_endpoint", endpoint]
        cmd += ["--rdzv_id", rdzv_id or cfg.run_name]
        if static:
            cmd += ["--node_rank", str(node_rank), "--rdzv_conf", f"timeout={RDZV_TIMEOUT_S}"]
        elif node is not None:
            cmd += ["--rdzv_conf", f"is_host={int(node == 0)},join_timeout={RDZV_TIMEOUT_S}"]
        if local_addr:
            cmd += ["--local_addr", local_addr]
    rank = "lmyard.launch.standby" if standby else "lmyard.stages"
    return [*cmd, "-m", rank, "train", *(["--spec", spec_path] if spec_path else [])]


def stage_command(cfg: RunConfig, spec: StageSpec, *, python: str = sys.executable, **torchrun) -> list[str]:
    """The command of one node: torchrun for training (see torchrun_command), one process for the others."""
    if isinstance(spec, TrainSpec):
        return torchrun_command(cfg, python=python, **torchrun)
    spec_path = torchrun.get("spec_path")
    return [python, "-m", "lmyard.stages", spec.stage, *(["--spec", spec_path] if spec_path else [])]


def stage_env(cfg: RunConfig) -> dict[str, str]:
    """Environment every launch gives torchrun: unbuffered output, and torchrun's own grace before it kills its
    ranks after a signal a little longer than the trainer's, so the checkpoint is committed before anything is
    killed (a rank that ends preempted first stops no other: lmyard.launch.torchrun).
    OMP_NUM_THREADS: torchrun sets 1 itself when it is unset, with a 4-line banner; set, it says nothing (the
    trainer sets its threads itself: train.threads_per_rank)."""
    return {
        "PYTHONUNBUFFERED": "1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(cfg.launch.grace_s) + 10),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
