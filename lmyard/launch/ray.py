"""The Ray backend of lmyard.launch: every stage on a cluster node; training as one actor per node in a
placement group, torchrun in each.

    run_ray(cfg, spec, on_line=log)

Design notes: docs/launch.md, `lmyard/launch/ray.py`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from lmyard.config import RunConfig
from lmyard.errors import NoSpace, TrainingFailed, UserError
from lmyard.launch.docker_job import _Masker, secret_names
from lmyard.launch.follower import Follower
from lmyard.launch.local_job import LocalJob
from lmyard.launch.ray_requests import SPECS, lost_nodes, on_cluster, request, runtime_env_refusal, unfit_error
from lmyard.stages import StageSpec, TrainResult, TrainSpec

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

NAMESPACE = "lmyard"  # the Ray namespace of the node actors: lmyard-<run>-<launch id>-node<i>
CALL_S = 60.0  # an actor that does not answer a call for this long is lost
OUTPUT_WAIT_S = 1.0  # how long one `output` call waits for new lines
KEEP_LINES = 10_000  # lines an actor keeps for a driver that fell behind


def address(cfg: RunConfig, environ: Mapping[str, str] | None = None) -> str:
    """launch.ray.address, else RAY_ADDRESS, else `auto`."""
    environ = os.environ if environ is None else environ
    return cfg.launch.ray.address or environ.get("RAY_ADDRESS") or "auto"


# ---------------------------------------------------------------- the driver's connection (one per process)

QUIET_ENV = ("MLFLOW_LOGGING_LEVEL", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")  # set by lmyard.console.install
_LOCK = threading.Lock()
_users = 0
_ours = False  # this module called ray.init, so it shuts the connection down after the last job


def _listening(addr: str) -> bool:
    """Whether something listens at host:port (Ray itself retries an absent GCS for minutes)."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return True
    except (OSError, ValueError):
        return False


def _connect(addr: str) -> None:
    """This process as a driver of the cluster at `addr`, or a UserError in one line."""
    global _users, _ours
    import ray

    def no_cluster(why: str) -> UserError:
        return UserError(
            f"launch.ray.address: no Ray cluster at {addr} ({why}); start one (`ray start --head`) "
            "or set launch.ray.address / RAY_ADDRESS to its head's host:port"
        )

    with _LOCK:
        if addr != "auto" and "://" not in addr and not _listening(addr):
            raise no_cluster("nothing answers there")
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if addr != "auto" and addr.rpartition(":")[2] != current.rpartition(":")[2]:
                raise UserError(
                    f"launch.ray.address is {addr}, but this process is a driver of the cluster at {current}"
                )
        else:
            try:
                quiet_driver()
                ray.init(address=addr, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
                _fold_cluster_errors()
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise no_cluster(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
            _ours = True
        _users += 1


class _SigtermHandlerNotSet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def quiet_driver() -> None:
    """Before ray.init in a flow's task thread: Ray warns that it set no SIGTERM handler there. None is wanted:
    Prefect's own, in the main thread, stops the job and records its end (Ray's would exit the process)."""
    worker = logging.getLogger("ray._private.worker")  # the logger of ray.init's module, by its name
    if not any(isinstance(f, _SigtermHandlerNotSet) for f in worker.filters):
        worker.addFilter(_SigtermHandlerNotSet())


_said: set[str] = set()  # the cluster's errors folded so far (each is published once per agent that saw it)
_log = logging.getLogger(__name__)


def _fold_cluster_errors() -> None:
    """Ray's driver prints what its cluster publishes (a raylet's death with the tail of its log, a node marked
    dead) straight to stdout, dozens of lines each, once per agent that saw it. Ray has no public hook for it:
    its printer is wrapped, where it is found, so that each such error is logged once, as its first line."""
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "folded", False):
        return

    def folded(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            return printer(data, ignore_prefix)
        for text in data.get("lines", []):
            lines = re.sub(r"\x1b\[[0-9;]*m", "", str(text)).strip().splitlines()
            first = lines[0].split(" Possible reasons", 1)[0][:300] if lines else ""
            if first and first not in _said:
                _said.add(first)
                _log.warning(f"Ray: {first}")

    folded.folded = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = folded


def _disconnect() -> None:
    global _users, _ours
    import ray

    with _LOCK:
        _users -= 1
        if _users == 0 and _ours:
            ray.shutdown()
            _ours = False


# ---------------------------------------------------------------- on each node: the actor


class NodeAgent:
    """Inside one node's actor: torchrun as a LocalJob, its output kept for the driver, its exchange folder."""

    def __init__(self) -> None:
        self.job: LocalJob | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=KEEP_LINES)
        self.total = 0  # lines printed so far; the deque holds the last ones
        self.code: int | None = None
        self.cond = threading.Condition()

    def where(self, rendezvous_port: bool) -> dict:
        """This node: its address, its Ray node id, and for node 0 a port free here for the rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        port = None
        if rendezvous_port:
            with socket.socket() as s:
                s.bind((ip, 0))
                port = s.getsockname()[1]
        return {
            "ip": ip,
            "port": port,
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
        }

    def start(self, stage: str, spec_json: str, env: dict[str, str], torchrun: dict) -> int:
        """Start the stage on this node (torchrun for training); its process id. The stage's own Ray calls
        (tokenize-and-shard's pieces) reach this cluster (RAY_ADDRESS)."""
        import ray

        spec = SPECS[stage].model_validate_json(spec_json)
        self.job = LocalJob(RunConfig.model_validate(spec.config), spec, **torchrun)
        self.job.env.update({**env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
        started: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, args=(started,), daemon=True, name="torchrun").start()
        if (error := started.get()) is not None:
            raise error
        assert self.job.proc is not None
        return self.job.proc.pid

    def _run(self, started: queue.Queue) -> None:
        # This thread forks torchrun and lives as long as it does: the parent-death signal LocalJob sets
        # follows the thread that forked, so it fires when the actor's process dies, and not before.
        assert self.job is not None
        events: queue.Queue = queue.Queue()
        try:
            self.job.start(events)
        except Exception as e:
            started.put(e)
            return
        started.put(None)
        while True:
            kind, _, value = events.get()
            with self.cond:
                if kind == "line":
                    self.lines.append(value)
                    self.total += 1
                else:
                    self.code = value
                self.cond.notify_all()
            if kind == "exit":
                return

    def output(self, offset: int, wait_s: float) -> tuple[list[str], int, int | None]:
        """Lines after the first `offset` (waiting up to wait_s for some), the new offset, the exit code once all
        lines are out."""
        with self.cond:
            self.cond.wait_for(lambda: self.total > offset or self.code is not None, timeout=wait_s)
            first = self.total - len(self.lines)
            return list(itertools.islice(self.lines, max(offset - first, 0), None)), self.total, self.code

    def read(self, name: str) -> bytes | None:
        return self.job.read(name) if self.job else None

    def read_all(self, folder: str) -> dict[str, bytes]:
        return self.job.read_all(folder) if self.job else {}

    def terminate(self) -> None:
        if self.job:
            self.job.terminate()

    def kill(self) -> None:
        if self.job:
            self.job.kill()

    def close(self) -> None:
        if self.job:
            self.job.close()


# ---------------------------------------------------------------- the driver: the job


class RayJob:
    """One actor per node in a placement group of a Ray cluster, or one actor for the stages of one node (see
    lmyard.launch.job.Job)."""

    def __init__(
        self, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], environ: Mapping[str, str] | None = None
    ):
        environ = os.environ if environ is None else environ
        rc, n = cfg.launch.ray, spec.nodes()
        if isinstance(spec, TrainSpec) and rc.gpus_per_node and rc.gpus_per_node < cfg.launch.nproc_per_node:
            raise UserError(
                f"launch.ray.gpus_per_node={rc.gpus_per_node} gives launch.nproc_per_node="
                f"{cfg.launch.nproc_per_node} ranks less than a GPU each: make them equal"
            )
        self.cfg, self.on_line, self.nodes = cfg, on_line, n
        self.spec: StageSpec = spec
        self.address, self.bundle = address(cfg, environ), request(cfg, spec)
        self.spec_json = on_cluster(cfg, spec)
        secrets = secret_names(rc, environ)
        faults = [k for k in environ if k.startswith("LMYARD_FAULT")]  # failure drills
        quiet = [k for k in QUIET_ENV if k in environ]  # the command line's quiet MLflow, on the nodes too
        self.env = {k: environ[k] for k in [*secrets, *faults, *quiet]}
        self.mask = _Masker([environ[k] for k in secrets])
        self.launch_id = uuid.uuid4().hex[:12]
        self.names = [f"lmyard-{cfg.run_name}-{self.launch_id}-node{i}"[:120] for i in range(n)]
        self.pg: PlacementGroup | None = None
        self.actors: list = []
        self.rank0: int | None = None  # the node that runs rank 0, once a file of it was seen
        self.where: list[dict] = []  # each node's address, Ray node id and host name, once its actor answered
        self.connected = False
        self.stopping = threading.Event()

    @classmethod
    def for_stage(
        cls, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> RayJob:
        return cls(cfg, spec, on_line)

    def placed(self) -> list[str]:
        """Where Ray placed each node: its host name and address (once its actor answered)."""
        return [f"{w['host']} ({w['ip']})" for w in self.where]

    def start(self, events: queue.Queue) -> None:
        import ray

        _connect(self.address)
        self.connected = True
        self._place()
        self._create_actors()
        timeout = self.cfg.launch.ray.placement_timeout_s  # actors may wait for a runtime_env (pip, image)
        where = self._get([a.where.remote(i == 0) for i, a in enumerate(self.actors)], timeout, "start its actors")
        endpoint, self.where = f"{where[0]['ip']}:{where[0]['port']}", where
        rdzv = dict(rdzv_endpoint=endpoint, rdzv_id=self.launch_id) if self.nodes > 1 else {}  # one node: standalone
        torchrun = [{**rdzv, **({"node": i} if rdzv else {}), "local_addr": w["ip"]} for i, w in enumerate(where)]
        stage = self.spec.stage
        starts = [a.start.remote(stage, self.spec_json, self.env, t) for a, t in zip(self.actors, torchrun)]
        # every start settled before one is judged: a node that fails at once (a full cache disk) must not send
        # close() to another still starting, which would find no job there and leave its exchange folder behind
        ray.wait(starts, num_returns=len(starts), timeout=CALL_S)
        pids = []
        for i, ref in enumerate(starts):
            try:
                pids += self._get([ref], CALL_S, "start")
            except ray.exceptions.RayTaskError as e:  # a full cache disk on that node: one line naming it
                if not isinstance(e.cause, NoSpace):
                    raise
                raise NoSpace(f"node {i} ({where[i]['host']}, {where[i]['ip']}): {e.cause}") from None
        for i, (w, pid) in enumerate(zip(where, pids)):
            self.on_line(f"node {i}: {stage} on Ray node {w['node_id']} at {w['ip']} (pid {pid}), bundle {self.bundle}")
        for i in range(self.nodes):
            threading.Thread(target=self._pump, args=(i, events), daemon=True, name=f"ray-node-{i}").start()

    def _get(self, refs: list, timeout: float, what: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TrainingFailed(f"Ray: could not {what} within {timeout:g} s") from None
        except ray.exceptions.RuntimeEnvSetupError as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            raise UserError(f"launch.ray.runtime_env: Ray could not set it up on a node: {first}") from None

    def _place(self) -> None:
        """The placement group of training: refused at once if the nodes can never hold it, else waited for (a
        busy cluster, a lost node coming back). The other stages' one actor is refused the same way, and waits
        for room as it starts."""
        import ray
        from ray.util.placement_group import placement_group

        if error := unfit_error(self.spec, ray.nodes(), self.bundle):
            raise error
        if not isinstance(self.spec, TrainSpec):
            return
        strategy = "STRICT_SPREAD" if self.nodes > 1 else "PACK"
        self.pg = pg = placement_group([dict(self.bundle)] * self.nodes, strategy=strategy, name=self.names[0][:-6])
        ready, timeout = pg.ready(), self.cfg.launch.ray.placement_timeout_s
        deadline = time.monotonic() + timeout
        while not ray.wait([ready], timeout=5)[0]:
            if time.monotonic() > deadline:
                nodes = ray.nodes()
                alive = sum(1 for n in nodes if n.get("Alive"))
                raise TrainingFailed(
                    f"Ray: no room for {self.nodes} x {self.bundle} ({strategy}) within launch.ray."
                    f"placement_timeout_s={timeout:g}: of the cluster's {alive} live nodes, too few are free"
                    + lost_nodes(nodes)
                )
            self.on_line(f"waiting for the Ray cluster to place {self.nodes} x {self.bundle} ({strategy})")

    def _create_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        agent = ray.remote(NodeAgent)
        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU", "memory")}
        for i, name in enumerate(self.names):
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i) if self.pg else "DEFAULT"
            with runtime_env_refusal():
                actor = agent.options(
                    name=name,
                    namespace=NAMESPACE,
                    num_cpus=self.bundle["CPU"],
                    num_gpus=self.bundle.get("GPU", 0),  # Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPUs
                    memory=self.bundle.get("memory"),
                    resources=custom,
                    max_concurrency=4,  # output waits while the follower reads files
                    max_restarts=0,
                    runtime_env=self.cfg.launch.ray.runtime_env or None,
                    scheduling_strategy=where,
                ).remote()
            self.actors.append(actor)

    def _pump(self, i: int, events: queue.Queue) -> None:
        import ray

        offset = 0
        try:
            while True:
                lines, offset, code = ray.get(self.actors[i].output.remote(offset, OUTPUT_WAIT_S), timeout=CALL_S)
                for line in lines:
                    events.put(("line", i, self.mask(line)))
                if code is not None:
                    events.put(("exit", i, code))
                    return
        except Exception as e:
            if not self.stopping.is_set():
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                at = f" ({self.where[i]['host']}, {self.where[i]['ip']})" if i < len(self.where) else ""
                events.put(("error", i, f"its Ray actor{at} is gone ({type(e).__name__}: {first})"))
                events.put(("exit", i, -1))  # its torchrun went with it: nothing left to wait for

    def _answers(self, refs: list) -> list:
        """Each ref's value, or None where its actor is gone or silent."""
        import ray

        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=CALL_S))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                out.append(None)
        return out

    def read(self, name: str) -> bytes | None:
        """A file of rank 0's node: the rendezvous orders nodes by (address, pid), so rank 0 may be on any
        node; the first node that has the file is that node from then on."""
        if self.rank0 is not None:
            return self._answers([self.actors[self.rank0].read.remote(name)])[0]
        for i, data in enumerate(self._answers([a.read.remote(name) for a in self.actors])):
            if data is not None:
                self.rank0 = i
                return data
        return None

    def read_all(self, folder: str) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for files in self._answers([a.read_all.remote(folder) for a in self.actors]):
            out.update(files or {})
        return out

    def terminate(self) -> None:
        for a in self.actors:
            a.terminate.remote()  # SIGTERM to torchrun and its ranks; the follower kills after launch.grace_s

    def kill(self) -> None:
        self._answers([a.kill.remote() for a in self.actors])

    def why(self, node: int, code: int) -> str:
        return " (killed)" if code in (-9, 137) else ""

    def close(self) -> None:
        """Stop torchrun and remove the exchange folder on every node, then the actors and the placement group;
        each step tolerates what is already gone."""
        self.stopping.set()
        if not self.connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            self._answers([a.close.remote() for a in self.actors])
            for a in self.actors:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.kill(a, no_restart=True)
            if self.pg is not None:
                remove_placement_group(self.pg)
            self._wait_gone()
        finally:
            _disconnect()

    def _wait_gone(self, timeout_s: float = 30) -> None:
        """Until no actor of this job is alive (ray.kill returns before the actor is dead)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
            if not alive & set(self.names):
                return
            time.sleep(0.2)


def run_ray(cfg: RunConfig, spec: TrainSpec | dict, on_line: Callable[[str], None] = print, **callbacks) -> TrainResult:
    """Run the trainer on a Ray cluster, one actor per node, and follow it (lmyard.launch.follower.Follower)."""
    spec = TrainSpec.model_validate(spec)
    return Follower(RayJob(cfg, spec, on_line), cfg, on_line, **callbacks).run()
