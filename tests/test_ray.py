"""The Ray backend on a real local Ray cluster of two nodes with one CPU each (ray.cluster_utils.Cluster).

The cluster (conftest.py's ray_cluster) is started once for this module, bound to 127.0.0.1, and shut down at the end. Every test
checks that no actor or placement group of its run is left behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import psutil
import pytest
from conftest import free_port, lmyard_cmd, tiny_overrides
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.store import open_store

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _actors(run_name: str) -> list[dict]:
    """Every actor of this run's launches, dead ones included (the GCS actor table; the state API needs
    Ray's dashboard, which plain `ray` lacks)."""
    return [a for a in ray._private.state.actors().values() if a["Name"].startswith(f"lmyard-{run_name}-")]


def _leftovers(run_name: str) -> tuple[list[str], list[str]]:
    """Live actors and placement groups of this run."""
    from ray.util.placement_group import placement_group_table

    alive = [a["Name"] for a in _actors(run_name) if a["State"] != "DEAD"]
    groups = [
        g["name"]
        for g in placement_group_table().values()
        if g["name"].startswith(f"lmyard-{run_name}-") and g["state"] != "REMOVED"
    ]
    return alive, groups


def _ray_cfg(tmp_path, steps: int = 6, **extra):
    sets = {"launch.backend": "ray", "launch.nnodes": 2, "launch.nproc_per_node": 1, **extra}
    return load_recipe("smoke", tiny_overrides(tmp_path, steps=steps, **sets))


def test_smoke_run_on_two_ray_nodes_finishes_commits_and_leaves_no_actor(ray_cluster, cli_env, tmp_path):
    sets = tiny_overrides(tmp_path, steps=6, **{"launch.nnodes": 2, "launch.nproc_per_node": 1})
    args = lmyard_cmd("run", "smoke", "--set", "launch.backend=ray", *[a for s in sets for a in ("--set", s)])
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    store = open_store(str(tmp_path / "store"))
    assert complete_steps(store, "smoke") == [3, 6]
    lineage = json.loads(store.read_bytes("runs/smoke/lineage.json"))
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(lineage["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    actors = _actors("smoke")
    assert len(actors) == 2
    assert {a["Address"]["NodeID"] for a in actors} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert _leftovers("smoke") == ([], [])


def _kill_actor(cluster, run_name: str) -> None:
    """ray.kill node 1's actor."""
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"lmyard-{run_name}-") and a["name"].endswith("-node1"):
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))


def _lose_node(cluster, run_name: str) -> None:
    """Remove the Ray node (not the head) that hosts one of the job's nodes, then add a fresh one in its place,
    as KubeRay replaces a lost pod."""
    hosts = {a["Address"]["NodeID"] for a in _actors(run_name) if a["State"] == "ALIVE"}
    (lost,) = [n for n in cluster.worker_nodes if n.node_id in hosts]
    cluster.remove_node(lost, allow_graceful=False)
    cluster.add_node(num_cpus=1)


@pytest.mark.parametrize("lose", [_kill_actor, _lose_node], ids=["actor-killed", "node-lost"])
def test_a_lost_node_fails_the_attempt_and_the_retry_resumes_from_the_checkpoint(
    ray_cluster, prefect_api_url, tmp_path, monkeypatch, lose
):
    from prefect import flow

    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.tracking.lineage import Lineage
    from tasks.train import train

    # every rank pauses 30 s after step 10 (the retry resumes after it): the node is lost in that window
    monkeypatch.setenv("LMYARD_FAULTS", "pause@10")
    monkeypatch.setenv("LMYARD_FAULT_PAUSE_S", "30")
    run_name = f"lost-{lose.__name__.strip('_').replace('_', '')}"
    cfg = _ray_cfg(
        tmp_path,
        steps=30,
        **{
            "run_name": run_name,
            "launch.ray.address": ray_cluster.address,
            "launch.grace_s": 20,
            "checkpoint.interval": 10,
            "eval.interval": 1000,
            "train.log_interval": 10,
        },
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, store, shard_address=shards.address, code_version="test")
    outcome: list = []

    @flow(name="train-only")
    def train_only() -> None:
        outcome.append(train.with_options(retries=1, retry_delay_seconds=0)(cfg, shards, lineage))

    # the flow in a thread: Ray adds a node from the main thread only
    flow_thread = threading.Thread(target=train_only, daemon=True)
    flow_thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not complete_steps(store, run_name):
        time.sleep(0.2)
    lose(ray_cluster, run_name)
    flow_thread.join(timeout=600)
    assert outcome, "the flow did not finish"
    result = outcome[0]
    assert len(lineage.attempts()) == 2
    assert result.start_step == 10 and result.step == 30
    assert complete_steps(store, run_name)[-1] == 30
    first = lineage.attempts()[0]["outcome"]
    assert re.match(r"failed: TrainingFailed: lost node \d: its Ray actor is gone", first), first
    actors = _actors(run_name)
    assert len(actors) == 4  # two launches of two nodes
    assert _leftovers(run_name) == ([], [])
    # the lost actor's torchrun went with it: no process of either launch's rendezvous is left
    launches = {a["Name"].split("-")[3] for a in actors}
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if launches & set(p.info["cmdline"] or [])]


def test_a_lost_raylet_is_one_line_said_once_and_the_run_ends_in_its_one_line(ray_cluster, cli_env, tmp_path):
    """Ray's driver is told of a raylet's death by each agent of its node, with the tail of its log: lmyard
    folds that into one line, once; the run's last line is lmyard's one line."""
    sets = tiny_overrides(
        tmp_path,
        steps=30,
        **{
            "run_name": "raylet",
            "launch.backend": "ray",
            "launch.nnodes": 2,
            "launch.nproc_per_node": 1,
            "launch.retries": 0,
            "checkpoint.interval": 10,
            "eval.interval": 1000,
            "train.log_interval": 10,
        },
    )
    # every rank pauses 60 s after step 10: the node is lost in that window
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address, "LMYARD_FAULTS": "pause@10", "LMYARD_FAULT_PAUSE_S": "60"}
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            lmyard_cmd("run", "smoke", *[a for s in sets for a in ("--set", s)]),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 400
            while "step 10/30" not in log.read_text() and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert "step 10/30" in log.read_text(), log.read_text()[-3000:]
            _lose_node(ray_cluster, "raylet")
            assert run.wait(timeout=600) == 1, log.read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
    text = log.read_text()
    assert text.count("Raylet is terminated") == 1, text[-5000:]
    (said,) = [line for line in text.splitlines() if "Raylet is terminated" in line]
    assert said.endswith("Ray: Raylet is terminated. Termination is unexpected."), said
    assert "[state-dump]" not in text
    assert text.strip().splitlines()[-1].startswith("lmyard: error: lost node "), text[-3000:]
    assert _leftovers("raylet") == ([], [])


@pytest.mark.parametrize(
    ("sets", "resource"),
    [({"launch.ray.gpus_per_node": 1}, "GPU >= 1"), ({"launch.ray.resources": "{TPU: 4}"}, "TPU >= 4")],
)
def test_a_request_the_cluster_can_never_fit_fails_in_one_line_naming_the_resource(
    ray_cluster, tmp_path, sets, resource
):
    from lmyard.launch.ray import run_ray

    cfg = _ray_cfg(tmp_path, **{"run_name": "unfit", "launch.ray.address": ray_cluster.address, **sets})
    spec = {
        "config": cfg.model_dump(mode="json"),
        "shards": {"address": "none", "uri": "none", "manifest": {}},
        "lineage": None,
    }
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        run_ray(cfg, spec, on_line=lambda s: None)
    assert time.monotonic() - t0 < 60
    assert re.search(f"0 of its \\d+ nodes have {resource}", str(e.value)) and "\n" not in str(e.value)
    assert _leftovers("unfit") == ([], [])


def test_no_cluster_at_the_address_fails_in_one_line(ray_cluster, tmp_path):
    from lmyard.launch.ray import run_ray

    cfg = _ray_cfg(tmp_path, **{"run_name": "nocluster", "launch.ray.address": f"127.0.0.1:{free_port()}"})
    spec = {
        "config": cfg.model_dump(mode="json"),
        "shards": {"address": "none", "uri": "none", "manifest": {}},
        "lineage": None,
    }
    with pytest.raises(UserError, match=r"^launch.ray.address: no Ray cluster at 127.0.0.1:\d+ ") as e:
        run_ray(cfg, spec, on_line=lambda s: None)
    assert "\n" not in str(e.value)
    assert _leftovers("nocluster") == ([], [])


def test_ray_address_comes_from_the_config_else_the_environment_else_auto(tmp_path):
    from lmyard.launch.ray import address

    cfg = _ray_cfg(tmp_path)
    assert address(cfg, {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert address(cfg, {}) == "auto"
    assert address(_ray_cfg(tmp_path, **{"launch.ray.address": "h:1"}), {"RAY_ADDRESS": "10.0.0.1:6379"}) == "h:1"


def test_stopping_a_ray_job_checkpoints_that_step_on_every_node_and_removes_its_actors(
    ray_cluster, tmp_path, monkeypatch
):
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.errors import Preempted
    from lmyard.launch.follower import stop_all
    from lmyard.launch.ray import run_ray

    monkeypatch.setenv("LMYARD_FAULTS", "pause@5")  # the ranks pause after step 5: a known step to stop at
    cfg = _ray_cfg(
        tmp_path,
        steps=12,
        **{"run_name": "stopped", "launch.ray.address": ray_cluster.address, "launch.grace_s": 60},
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}

    def on_line(line: str) -> None:
        if "step 5/12" in line:
            stop_all()  # what a cancelled flow run does: SIGTERM to torchrun on every node

    with pytest.raises(Preempted, match="stopped by SIGTERM after step 5"):
        run_ray(cfg, spec, on_line=on_line)
    assert 5 in complete_steps(open_store(cfg.store), "stopped")
    assert _leftovers("stopped") == ([], [])
