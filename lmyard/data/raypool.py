"""Tokenize-and-shard's read pieces as Ray tasks over a cluster's nodes (the shard stage on launch.backend=ray).

    shards, reused = tokenize_and_shard(cfg, start_pool=RayPool)  # cfg.data.num_proc: e.g. cluster_cpus()

Design notes: docs/data.md, `lmyard/data/raypool.py`.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from concurrent.futures import Future
from typing import Any

PIECE_RETRIES = 3  # a piece whose node (or worker) died runs again elsewhere, this many times at most
_ready: str | None = None  # in a Ray worker process: the pool whose tokenizer it holds


def _run_piece(pool: str, initargs: list, index: int, fn, *args) -> tuple[Any, str]:
    """Inside a Ray worker: the tokenizer of this pool (once per process), then one piece; (result, node id)."""
    global _ready
    import ray

    from lmyard import faults
    from lmyard.data import token_stream
    from lmyard.data.sources import Unit

    if _ready != pool:
        token_stream.init_worker(*ray.get(initargs[0]))  # in a list: Ray leaves the reference to this process
        _ready = pool
    for arg in args:
        if isinstance(arg, Unit):
            _fetch_missing(arg)
    faults.delay("pause_piece", index, "LMYARD_FAULT_PAUSE_S", 5.0)  # failure drills: a node lost mid-piece
    return fn(*args), ray.get_runtime_context().get_node_id()


def _fetch_missing(unit) -> None:
    """S3 objects this node's cache lacks, fetched to the path the stage's node has them at."""
    from lmyard.errors import UserError
    from lmyard.store import s3_client, s3_errors

    for p in unit.pieces:
        if os.path.exists(p.path) or not p.name.startswith("s3://"):
            continue
        if f"{os.sep}utf8-clean{os.sep}" in p.path:  # a cleaned copy (on_decode_error=skip) exists on one node
            raise UserError(
                f"data.source {p.name}: its cleaned copy {p.path} is not on this Ray node; with "
                "data.on_decode_error=skip, give the nodes one LMYARD_CACHE on a shared filesystem"
            )
        bucket, _, key = p.name.removeprefix("s3://").partition("/")
        os.makedirs(os.path.dirname(p.path), exist_ok=True)
        part = f"{p.path}.{uuid.uuid4().hex[:8]}.part"
        with s3_errors(f"data.source {p.name}"):
            s3_client().download_file(bucket, key, part)
        os.replace(part, p.path)


_ours = False  # this module connected the process to the cluster, and disconnects it


def cluster_cpus(address: str | None = None) -> int:
    """The CPUs of the cluster's live nodes: the stage's default data.num_proc; connects this process to the
    cluster (RAY_ADDRESS, else `auto`) first if it is not yet a driver of one."""
    global _ours
    import ray

    if not ray.is_initialized():
        addr = address or os.environ.get("RAY_ADDRESS") or "auto"
        ray.init(address=addr, log_to_driver=False, logging_level=logging.WARNING)
        _ours = True
    return max(int(sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive"))), 1)


class RayPool:
    """Read pieces as Ray tasks (see the module doc), `num_proc` CPUs wide."""

    def __init__(self, num_proc: int, initargs: tuple):
        import ray

        cluster_cpus()  # this process a driver of the cluster
        self.num_proc = num_proc
        self.key = uuid.uuid4().hex
        self.initargs = [ray.put(initargs)]
        self.task = ray.remote(_run_piece).options(
            num_cpus=1, scheduling_strategy="SPREAD", max_retries=PIECE_RETRIES, retry_exceptions=False
        )
        self.nodes: list[str] = []  # the node that read piece i
        self.pending: dict[int, Any] = {}
        self.lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        import ray

        with self.lock:
            index = len(self.nodes)
            self.nodes.append("")
            ref = self.pending[index] = self.task.remote(self.key, self.initargs, index, fn, *args)
        out: Future = Future()

        def done(f: Future) -> None:
            with self.lock:
                self.pending.pop(index, None)
            try:
                result, node = f.result()
            except ray.exceptions.RayTaskError as e:  # the piece's own exception, as a local pool gives it
                out.set_exception(e.cause if isinstance(e.cause, BaseException) else e)
                return
            except BaseException as e:
                out.set_exception(e)
                return
            self.nodes[index] = node
            out.set_result(result)

        ref.future().add_done_callback(done)
        return out

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        import ray

        with self.lock:
            left = list(self.pending.values())
        for ref in left:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already done, or its node gone
                pass
        global _ours
        if _ours:
            ray.shutdown()
            _ours = False
