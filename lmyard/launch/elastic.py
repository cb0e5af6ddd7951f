"""Elastic training: a lost node does not end the run, and the run grows back at a step boundary.

    result = run_elastic(spec, on_line, make_job, on_resize=record)

With launch.min_nnodes below launch.nnodes, a launch that fails with lost nodes (their engine or actor gone, cut
off from node 0, or not healthy once it ended: each backend's `Members`) relaunches at once on the healthy nodes,
from the last committed checkpoint, with the same global batch and token stream; fewer than min_nnodes: the error
goes up as before. While below full size, the lacking nodes are asked again every GROW_POLL_S (launch.grow_back);
once some are back, the launch is stopped as a preemption (every rank commits the step it is at) and relaunched on
all of them. `on_resize` is told of each change and may hand back the lineage of the attempt it records. What
counts as healthy on each backend, and the limits: docs/multi-host.md.
"""

from __future__ import annotations

import pkgutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lmyard.config import RunConfig
from lmyard.errors import one_line, retryable
from lmyard.launch.follower import Follower
from lmyard.launch.job import Job
from lmyard.stages import TrainResult, TrainSpec
from lmyard.tracking.lineage import Lineage, LineageRef

HEALTH_S = 5.0  # how long a node's engine is given to answer
GROW_POLL_S = 5.0  # how often a run below launch.nnodes asks the nodes it lacks again


@dataclass
class Resize:
    """A change of size between two launches of one training, as on_resize is told of it."""

    nodes: int  # the node count of the next launch
    hosts: list[str]  # its nodes' hosts
    reason: str  # "lost node 1 (host-b): ..." or "grew back: host-b is healthy again"
    grew: bool


class Members:
    """The nodes of a training on one backend: which are healthy, which of those it lacks have come back, the
    config of a launch on some of them. A node is a slot, 0 .. launch.nnodes - 1."""

    def __init__(self, cfg: RunConfig, spec: TrainSpec | None = None):
        self.cfg, self.spec = cfg, spec

    def healthy(self, slots: list[int]) -> list[int]:
        """Those of `slots` that are healthy."""
        return slots

    def returning(self, using: list[int], lacking: list[int]) -> list[int]:
        """Those of `lacking` that are healthy again (the run uses `using`)."""
        return self.healthy(lacking)

    def host(self, slot: int) -> str:
        return f"node {slot}"

    def config(self, slots: list[int]) -> RunConfig:
        """The config of a launch on `slots` (launch.nnodes their count); elasticity is this module's, not its."""
        data = self.cfg.model_dump(mode="json")
        data["launch"].update(nnodes=len(slots), min_nnodes=None)
        return RunConfig.model_validate(self._narrow(data, slots))

    def _narrow(self, data: dict, slots: list[int]) -> dict:
        return data


class DockerMembers(Members):
    """Docker: node i runs on engine launch.docker.nodes[i] (or the one engine of every node)."""

    def url(self, slot: int) -> str:
        urls = self.cfg.launch.docker.nodes
        return urls[slot] if len(urls) > 1 else urls[0]

    def host(self, slot: int) -> str:
        addrs = self.cfg.launch.docker.node_addrs
        return f"node {slot} ({addrs[slot] if addrs else self.url(slot)})"

    def healthy(self, slots: list[int]) -> list[int]:
        if not slots:
            return []
        with ThreadPoolExecutor(len(slots)) as pool:
            answers = list(pool.map(lambda s: _engine_answers(self.url(s)), slots))
        return [s for s, ok in zip(slots, answers, strict=True) if ok]

    def _narrow(self, data: dict, slots: list[int]) -> dict:
        dc = data["launch"]["docker"]
        for key in ("nodes", "node_addrs", "node_gpus"):
            if dc.get(key) and len(dc[key]) == self.cfg.launch.nnodes > 1:
                dc[key] = [dc[key][s] for s in slots]
        return data


class RayMembers(Members):
    """Ray: the cluster places the nodes; the slots in use are filled by any live nodes that can hold a bundle."""

    def live(self) -> int:
        """The cluster's live nodes that can each hold one bundle."""
        import ray

        from lmyard.launch import ray as backend
        from lmyard.launch.ray_requests import fitting, request

        assert self.spec is not None
        backend._connect(backend.address(self.cfg))
        try:
            return len(fitting(request(self.cfg, self.spec), ray.nodes()))
        finally:
            backend._disconnect()

    def healthy(self, slots: list[int]) -> list[int]:
        return slots[: self.live()]

    def returning(self, using: list[int], lacking: list[int]) -> list[int]:
        return lacking[: max(0, self.live() - len(using))]

    def host(self, slot: int) -> str:
        return f"Ray node {slot}"


def _engine_answers(url: str) -> bool:
    import docker

    try:
        client = docker.DockerClient(base_url=url, timeout=HEALTH_S, use_ssh_client=url.startswith("ssh://"))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # refused, timed out, gone: not healthy (a tcp engine's TLS is the launch's own check)
        return False


def members(cfg: RunConfig, spec: TrainSpec | None = None) -> Members:
    """The backend's Members (its row of lmyard.backends names them)."""
    from lmyard import backends

    return pkgutil.resolve_name(backends.of(cfg).members)(cfg, spec)


class _GrowBack:
    """While a launch below full size runs: asks the nodes it lacks every GROW_POLL_S; once some are back, stops
    the launch as a preemption (after every rank's first step: the trainer's SIGTERM handler is then in place)."""

    def __init__(self, group: Members, follower: Follower, using: list[int], lacking: list[int]):
        self.group, self.follower, self.using, self.lacking = group, follower, using, lacking
        self.found: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="grow-back")
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(GROW_POLL_S):
            if not self.follower.stepped or self.follower.stop_requested.is_set():
                continue
            try:
                back = self.group.returning(self.using, self.lacking)
            except Exception:  # the cluster does not answer now: ask again later
                continue
            if back:
                self.found = back
                self.follower.stop()
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join()


def run_elastic(
    spec: TrainSpec,
    on_line: Callable[[str], None],
    make_job: Callable[[RunConfig, TrainSpec], Job],
    *,
    on_resize: Callable[[Resize], LineageRef | None] | None = None,
    **callbacks,
) -> TrainResult:
    """Train on launch.nnodes nodes, going on with at least launch.min_nnodes of them (see the module doc)."""
    cfg = spec.config
    group = members(cfg, spec)
    full = list(range(cfg.launch.nnodes))
    using, cut_off = list(full), set[int]()  # cut_off: nodes lost to their network, not grown back
    while True:
        launch_cfg = group.config(using) if len(using) < len(full) else cfg
        follower = Follower(
            make_job(launch_cfg, spec.model_copy(update={"config": launch_cfg})), launch_cfg, on_line, **callbacks
        )
        lacking = [s for s in full if s not in using and s not in cut_off]
        grow = _GrowBack(group, follower, using, lacking) if cfg.launch.grow_back and lacking else None
        try:
            return follower.run()
        except Exception as e:
            if grow is not None:
                grow.close()
            if grow is not None and grow.found and follower.stop_requested.is_set():
                resize = Resize(len(using) + len(grow.found), [], _grew(group, grow.found), True)
                using = sorted(using + grow.found)
            elif (shrunk := _shrink(group, follower, e, using, cut_off)) is None:
                raise
            else:
                using, resize = shrunk
            resize.hosts = [group.host(s) for s in using]
            on_line(f"resize: {launch_cfg.launch.nnodes} -> {resize.nodes} nodes ({resize.reason})")
            ref = on_resize(resize) if on_resize is not None else None
            spec = spec.model_copy(update={"lineage": ref}) if ref is not None else spec
        finally:
            if grow is not None:
                grow.close()


def attempt_hosts(cfg: RunConfig) -> list[str]:
    """The hosts of a launch at launch.nnodes, as the lineage's attempt records them."""
    group = members(cfg)
    return [group.host(s) for s in range(cfg.launch.nnodes)]


def record_resize(lineage: Lineage, r: Resize) -> Lineage:
    """End the lineage's attempt as resized and record the next one on r's nodes (tags nodes, hosts, resized; its
    start step is what its trainer loads, Lineage.record_resume)."""
    lineage.end_attempt("resized", r.reason)
    info = {"nodes": r.nodes, "hosts": ", ".join(r.hosts), "resized": r.reason}
    return lineage.record_attempt(resumed_from=None, start_step=0, info=info)


def _grew(group: Members, back: list[int]) -> str:
    return f"grew back: {', '.join(group.host(s) for s in back)} healthy again"


def _shrink(
    group: Members, follower: Follower, error: Exception, using: list[int], cut_off: set[int]
) -> tuple[list[int], Resize] | None:
    """After a failed launch: the healthy nodes to go on with and why, or None when the error goes up (not one a
    rerun helps, nothing lost, a stop that was asked for, fewer than launch.min_nnodes left)."""
    if not retryable(error) or follower.stop_requested.is_set() or group.cfg.launch.fewest_nodes() >= len(using):
        return None
    lost = {using[i] for i in follower.lost if i < len(using)}
    cut_off |= {using[i] for i in follower.cut_off if i < len(using)}
    left = group.healthy([s for s in using if s not in lost])
    lost |= set(using) - set(left)
    if not lost or len(left) < group.cfg.launch.fewest_nodes():
        return None
    reason = f"lost {', '.join(group.host(s) for s in sorted(lost))}: {one_line(error)}"[:500]
    return left, Resize(len(left), [], reason, False)
