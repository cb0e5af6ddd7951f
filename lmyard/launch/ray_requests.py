"""What a stage asks of a Ray cluster: its bundle, whether the cluster can ever hold it, the spec as nodes read it.

    need = request(cfg, spec)            # {"CPU": 1.0, "GPU": 1.0} for an evaluation on cuda
    why = unfit(need, nnodes, ray.nodes())

Training asks for one bundle per node (`launch.ray`: CPUs, default one per rank, GPUs and custom resources).
The other stages run on one node: the evaluation one GPU when `eval.device` names cuda (Ray gives the actor
that GPU, which the stage then sees as `cuda`), else `eval.threads` CPUs (none reserved when unset: it runs
beside training, as locally, and is not queued behind it); the export
one CPU; tokenize-and-shard's coordinator no CPU but `SHARD_MEMORY` of Ray's `memory` resource (its read
pieces are Ray tasks of one CPU each, lmyard.data.raypool, so that every CPU of the cluster reads pieces).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.launch.docker_job import _local_store_root, _sqlite_dir
from lmyard.stages import EvalSpec, ExportSpec, ShardSpec, StageSpec, TrainSpec

SHARD_MEMORY = 512 << 20  # tokenize-and-shard's coordinator: the pieces in flight, two shards, the upload
SPECS: dict[str, type[StageSpec]] = {c.stage: c for c in (ShardSpec, TrainSpec, EvalSpec, ExportSpec)}


def train_request(cfg: RunConfig) -> dict[str, float]:
    """One node's bundle of training (see the module doc)."""
    rc = cfg.launch.ray
    out = {"CPU": float(rc.cpus_per_node or cfg.launch.nproc_per_node)}
    if rc.gpus_per_node:
        out["GPU"] = float(rc.gpus_per_node)
    return {**out, **{k: float(v) for k, v in rc.resources.items()}}


def request(cfg: RunConfig, spec: StageSpec) -> dict[str, float]:
    """One node's resources for `spec`'s stage (see the module doc)."""
    if isinstance(spec, TrainSpec):
        return train_request(cfg)
    if isinstance(spec, EvalSpec) and cfg.eval.device.startswith("cuda"):
        return {"CPU": 1.0, "GPU": 1.0}
    if isinstance(spec, EvalSpec):  # beside training, as locally: the CPUs of eval.threads, else none reserved
        return {"CPU": float(cfg.eval.threads or 0)}
    if isinstance(spec, ShardSpec):
        return {"CPU": 0.0, "memory": float(SHARD_MEMORY)}
    return {"CPU": 1.0}


def unfit(need: dict[str, float], nnodes: int, nodes: list[dict], needs: str | None = None) -> str | None:
    """Why `nnodes` bundles `need` can never sit on distinct nodes, from every node the cluster has had
    (`ray.nodes()`); None if they can. A dead node may come back, but Ray lists it without its resources: where a
    live node can hold the bundle, each dead one is counted as one more that could (the job then waits for it, up
    to launch.ray.placement_timeout_s); where none can, the request is refused."""
    totals = [n.get("Resources") or {} for n in nodes if n.get("Alive", True)]
    needs = needs or f"launch.nnodes={nnodes} needs {nnodes}"
    need = {k: v for k, v in need.items() if v > 0}
    for key, amount in need.items():
        having = sum(1 for t in totals if t.get(key, 0) >= amount)
        if having < nnodes and not (having and having + len(nodes) - len(totals) >= nnodes):
            return f"{having} of its {len(totals)} nodes have {key} >= {amount:g} and {needs}"
    having = sum(1 for t in totals if all(t.get(k, 0) >= v for k, v in need.items()))
    if having < nnodes and not (having and having + len(nodes) - len(totals) >= nnodes):
        return f"{having} of its {len(totals)} nodes have all of {need} together and {needs}"
    return None


def lost_nodes(nodes: list[dict]) -> str:
    """What a placement that timed out says of the nodes the cluster lost (none at a live node's address): where
    they were and what to do; '' when none."""
    live = {n.get("NodeManagerAddress") for n in nodes if n.get("Alive")}
    dead = sorted({n.get("NodeManagerAddress", "?") for n in nodes if not n.get("Alive")} - live)
    if not dead:
        return ""
    return (
        f"; lost nodes at {', '.join(dead)}: start Ray there again (`ray start --address=...`, docs/multi-host.md), "
        "or lower launch.min_nnodes"
    )


def fitting(need: dict[str, float], nodes: list[dict]) -> list[dict]:
    """The live nodes of `ray.nodes()` that can each hold one bundle `need`."""
    need = {k: v for k, v in need.items() if v > 0}
    return [
        n for n in nodes if n.get("Alive") and all((n.get("Resources") or {}).get(k, 0) >= v for k, v in need.items())
    ]


def unfit_error(spec: StageSpec, nodes: list[dict], need: dict[str, float]) -> UserError | None:
    """The one line when the cluster can never hold `spec`'s stage, naming the resource and what to change."""
    if isinstance(spec, TrainSpec):
        if why := unfit(need, spec.nodes(), nodes):
            return UserError(
                f"launch.ray: the Ray cluster can never place this job: {why} (one bundle per node); lower "
                "launch.nnodes or the bundle (launch.nproc_per_node, launch.ray.cpus_per_node/gpus_per_node/"
                "resources), or add nodes"
            )
        return None
    if not (why := unfit(need, 1, nodes, needs=f"the {spec.stage} stage needs one")):
        return None
    fix = (
        f"set eval.device=cpu (now {spec.config.eval.device}) or add a node with a GPU"
        if "GPU" in need
        else "lower launch.ray.cpus_per_node or add a larger node"
    )
    return UserError(f"launch.ray: the Ray cluster can never place the {spec.stage} stage: {why}; {fix}")


def _absolute(path: str) -> str:
    """A local path as every node reads it (the actors do not share the launcher's working folder)."""
    if "://" in path or path.startswith("builtin:"):
        return path
    local = os.path.expanduser(path)
    return os.path.abspath(local) if path.startswith((".", "~")) or os.path.exists(local) else path


def on_cluster(cfg: RunConfig, spec: StageSpec) -> str:
    """The spec as the nodes read it: a local-folder store, a local data source, an export's folders and a sqlite
    tracking file by absolute path (such paths serve nodes on this machine or a shared filesystem); an
    evaluation on cuda on the one GPU Ray gives it."""
    data = spec.model_dump(mode="json")
    config = data["config"]
    if (root := _local_store_root(cfg.store)) is not None:
        config["store"] = root
    config["data"]["source"] = _absolute(config["data"]["source"])
    for source in config["data"].get("sources") or []:
        source["source"] = _absolute(source["source"])
    if isinstance(spec, EvalSpec) and cfg.eval.device.startswith("cuda"):
        config["eval"]["device"] = "cuda"
    for key in ("source", "dest"):  # an export's checkpoint and folder
        if isinstance(data.get(key), str) and "://" not in data[key]:
            data[key] = os.path.abspath(os.path.expanduser(data[key]))
    lineage = data.get("lineage")
    if lineage and (sqlite := _sqlite_dir(lineage["tracking_uri"])):
        lineage["tracking_uri"] = sqlite[0]
    return type(spec).model_validate(data).model_dump_json()


@contextlib.contextmanager
def runtime_env_refusal() -> Iterator[None]:
    """Ray refusing launch.ray.runtime_env as the actors are made (a TypeError or ValueError of its validation):
    one line, a UserError, so the attempt is not retried as a crash."""
    try:
        yield
    except (TypeError, ValueError) as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"launch.ray.runtime_env: Ray refused it: {first}") from None
