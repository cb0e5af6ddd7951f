"""The local backend's job: the stage as a child process group of this process, torchrun for training.

    result = run_local(cfg, spec, on_line=print)

`LocalJob` (a lmyard.launch.job.Job; `LocalJob.for_stage` is the backend table's factory, lmyard.backends.local)
and `run_local`, which follows one with the Follower (lmyard.launch.follower).

Design notes: docs/launch.md, `lmyard/launch/local_job.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.launch import jobdirs, standby
from lmyard.launch.follower import Follower
from lmyard.launch.job import stage_command, stage_env
from lmyard.stages import EXCHANGE_ENV, Exchange, StageSpec, TrainSpec, read_beats, write_json
from lmyard.stages.startup import LAUNCHED_AT_ENV


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGTERM to torchrun if the launching process dies,
    # and torchrun then stops its workers.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class LocalJob:
    """The stage as a child process group of this process: torchrun for training (one node, or one of several
    with rdzv_endpoint), `python -m lmyard.stages STAGE` for the others. `torchrun` takes torchrun_command's keywords: a
    Ray node's actor names its rendezvous and address."""

    nodes = 1

    def __init__(self, cfg: RunConfig, spec: StageSpec, **torchrun):
        self.spec = spec
        self.folder = jobdirs.new_job_folder(spec.stage)  # removed by close(); a dead launcher's, by the next job
        self.exchange = Exchange(self.folder)
        write_json(self.exchange.path("spec.json"), spec)
        self.env = {**os.environ, **stage_env(cfg), EXCHANGE_ENV: self.folder}
        self.standbys, self.ranks = None, cfg.launch.nproc_per_node
        here = backends.of(cfg).on_flow_host  # the launcher lives across attempts (not a Ray node's actor)
        if isinstance(spec, TrainSpec) and here and standby.wanted(cfg.launch.standby, cfg.train.device):
            self.standbys = standby.pool()  # this attempt's ranks start in its waiting standbys, if any
            self.env[standby.STANDBY_ENV] = self.standbys.folder
            torchrun["standby"] = True
        self.cmd = stage_command(cfg, spec, spec_path=self.exchange.path("spec.json"), **torchrun)
        self.proc: subprocess.Popen | None = None

    @classmethod
    def for_stage(
        cls, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> LocalJob:
        return cls(cfg, spec)

    def start(self, events: queue.Queue) -> None:
        if self.standbys is not None:  # the node's first attempt: its ranks' standbys warm up beside torchrun
            self.standbys.prestart(self.ranks, self.env)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**self.env, LAUNCHED_AT_ENV: f"{time.time():.3f}"},  # the trainer's startup parts start here
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for raw in self.proc.stdout:
                events.put(("line", 0, raw.rstrip("\n")))
            events.put(("exit", 0, self.proc.wait()))

        threading.Thread(target=pump, daemon=True, name=f"{self.spec.stage}-output").start()
        if self.standbys is not None:
            threading.Thread(target=self._refill, daemon=True, name="standby-refill").start()

    def _refill(self) -> None:
        """Once every rank has stepped (torchrun and the ranks took the standbys that were warm, and the restart's
        imports are done): standbys for the next attempt's torchrun and ranks, warm long before this one ends."""
        while self.proc is not None and self.proc.poll() is None:
            if len(self.read_all("heartbeat")) >= self.ranks and self.standbys is not None:
                self.standbys.refill(self.ranks + 1, self.env)
                return
            time.sleep(1.0)

    def read(self, name: str) -> bytes | None:
        try:
            with open(self.exchange.path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read_all(self, folder: str) -> dict[str, bytes]:
        return {k: v.encode() for k, v in read_beats(self.exchange.path(folder)).items()}

    def _signal(self, sig: int) -> None:
        """`sig` to torchrun's process group and to every process under torchrun: torch's elastic agent starts
        each rank in a session of its own, which a signal to torchrun's group alone does not reach (a SIGKILLed
        torchrun would leave its ranks running)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def why(self, node: int, code: int) -> str:
        return " (killed)" if code in (-9, 137) else ""

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_local(cfg: RunConfig, spec: StageSpec | dict, on_line: Callable[[str], None] = print, **callbacks):
    """Run a stage here and follow it (a dict is a TrainSpec); its result, or the error its exit code names."""
    spec = spec if isinstance(spec, StageSpec) else TrainSpec.model_validate(spec)
    return Follower(LocalJob(cfg, spec), cfg, on_line, **callbacks).run()
