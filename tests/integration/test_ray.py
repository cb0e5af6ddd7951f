"""The Ray backend on a real local Ray cluster of two nodes with one CPU each (`ray_cluster`, tests/conftest.py).

The cluster is started once for this module, bound to 127.0.0.1, and shut down at the end. Every test
checks that no actor or placement group of its run is left behind. Training first; then the other stages:
tokenize-and-shard's pieces as Ray tasks over the nodes (the corpus is a parquet file of many small row
groups, each row group one read piece), evaluate and export on a cluster node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import free_port, lmyard_cmd, ray_actors, ray_leftovers, tiny_overrides, write_random_checkpoint
from mlflow.tracking import MlflowClient

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.launch.launcher import launch
from lmyard.launch.ray_requests import SHARD_MEMORY
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.stages import EvalResult, EvalSpec, ExportResult, ExportSpec, ShardResult, ShardSpec
from lmyard.store import open_store

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _ray_cfg(tmp_path, steps: int = 6, **extra):
    sets = {"launch.backend": "ray", "launch.nnodes": 2, "launch.nproc_per_node": 1, **extra}
    return load_recipe("smoke", tiny_overrides(tmp_path, steps=steps, **sets))


def test_smoke_run_on_two_ray_nodes_finishes_commits_and_leaves_no_actor(ray_cluster, cli_env, tmp_path):
    sets = tiny_overrides(tmp_path, steps=6, **{"launch.nnodes": 2, "launch.nproc_per_node": 1})
    args = lmyard_cmd("run", "smoke", "--set", "launch.backend=ray", *[a for s in sets for a in ("--set", s)])
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr  # the nodes' MLflow is as quiet as the local trainer's; Ray's thread warning not
    assert " INFO mlflow" not in said and "SIGTERM handler is not set" not in said, said[-3000:]

    store = open_store(str(tmp_path / "store"))
    assert complete_steps(Run("smoke", store)) == [3, 6]
    lineage = json.loads(store.read_bytes("runs/smoke/lineage.json"))
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(lineage["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    training = _training_actors("smoke", alive_only=False)
    assert len(training) == 2
    assert {a["Address"]["NodeID"] for a in training} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(ray_actors("smoke")) > 2  # shard, evaluate and export ran on the cluster too
    assert ray_leftovers("smoke") == ([], [])


def _training_actors(run_name: str, alive_only: bool = True) -> list[dict]:
    """The actors of the run's training launches (those of two nodes; the other stages' launches have one)."""
    actors = [a for a in ray_actors(run_name) if a["State"] == "ALIVE" or not alive_only]
    launches = {a["Name"].rsplit("-", 1)[0] for a in actors if a["Name"].endswith("-node1")}
    return [a for a in actors if a["Name"].rsplit("-", 1)[0] in launches]


def _kill_actor(cluster, run_name: str) -> None:
    """ray.kill node 1's actor."""
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"lmyard-{run_name}-") and a["name"].endswith("-node1"):
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))


def _lose_node(cluster, run_name: str) -> None:
    """Remove the Ray node (not the head) that hosts one of the job's nodes, then add a fresh one in its place,
    as KubeRay replaces a lost pod."""
    hosts = {a["Address"]["NodeID"] for a in _training_actors(run_name)}
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

    # every rank pauses 12 s after step 10 (the retry resumes after it): the node is lost in that window
    monkeypatch.setenv("LMYARD_FAULTS", "pause@10")
    monkeypatch.setenv("LMYARD_FAULT_PAUSE_S", "12")
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
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address=shards.address, code_version="test")
    outcome: list = []

    @flow(name="train-only")
    def train_only() -> None:
        outcome.append(train.with_options(retries=1, retry_delay_seconds=0)(cfg, shards, lineage))

    # the flow in a thread: Ray adds a node from the main thread only
    flow_thread = threading.Thread(target=train_only, daemon=True)
    flow_thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not complete_steps(Run(run_name, store)):
        time.sleep(0.2)
    lose(ray_cluster, run_name)
    flow_thread.join(timeout=600)
    assert outcome, "the flow did not finish"
    result = outcome[0]
    assert len(lineage.attempts()) == 2
    assert result.start_step == 10 and result.step == 30
    assert complete_steps(Run(run_name, store))[-1] == 30
    first = lineage.attempts()[0]["outcome"]
    assert re.match(r"failed: TrainingFailed: lost node \d: its Ray actor \(\S+, [\d.]+\) is gone", first), first
    actors = ray_actors(run_name)
    assert len(actors) == 4  # two launches of two nodes
    assert ray_leftovers(run_name) == ([], [])
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
    # every rank pauses 12 s after step 10: the node is lost in that window (a second after the step's line), and
    # the rank left ends once its pause does (the run waits for it)
    env = {**cli_env, "RAY_ADDRESS": ray_cluster.address, "LMYARD_FAULTS": "pause@10", "LMYARD_FAULT_PAUSE_S": "12"}
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
    assert ray_leftovers("raylet") == ([], [])


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
    assert ray_leftovers("unfit") == ([], [])


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
    assert ray_leftovers("nocluster") == ([], [])


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
    assert 5 in complete_steps(Run("stopped", open_store(cfg.store)))
    assert ray_leftovers("stopped") == ([], [])


# ---------------------------------------------------------------- the other stages on the cluster

ROW_GROUPS = 16


@pytest.fixture(scope="module")
def sharded_here(tmp_path_factory) -> tuple[str, str, str]:
    """(corpus, store, address): ~40 KB of text in ROW_GROUPS parquet row groups (as many read pieces), and its
    shard set made here by the local stage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("ray-shards")
    words = "the quick brown fox jumps over a lazy dog while seven tired owls count sheep".split()
    texts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(20 + i % 30)) for i in range(16 * ROW_GROUPS)]
    corpus = str(tmp / "corpus.parquet")
    pq.write_table(pa.table({"text": texts}), corpus, row_group_size=16)
    assert pq.ParquetFile(corpus).metadata.num_row_groups == ROW_GROUPS
    shards, _ = tokenize_and_shard(_cfg(tmp, corpus, **{"data.num_proc": 1}), log=lambda s: None)
    return corpus, str(tmp / "store"), shards.address


def _cfg(tmp, corpus: str, **extra):
    sets = {
        "data.source": corpus,
        "tokenizer.name": "bytes",
        "data.shard_tokens": 4096,
        "data.val_every": 4,
        "eval.val_tokens": 512,
        "eval.sample_tokens": 4,
        **extra,
    }
    return load_recipe("smoke", tiny_overrides(tmp, **sets))


def _same_shard_sets(address: str, a_store: str, b_store: str) -> None:
    """The two stores hold the same manifest (but its timing) and byte-identical shards at `address`."""
    sa, sb = open_store(a_store), open_store(b_store)
    ma, mb = (json.loads(s.read_bytes(f"shards/{address}/manifest.json")) for s in (sa, sb))
    ma.pop("created_s"), mb.pop("created_s")
    assert ma == mb
    assert len(ma["shards"]) > 2
    for entry in ma["shards"]:
        key = f"shards/{address}/{entry['name']}"
        assert sa.read_bytes(key) == sb.read_bytes(key), entry["name"]


def _stage_line(lines: list[str], stage: str) -> tuple[str, int]:
    """(Ray node id, pid) that the launch says ran `stage`."""
    (line,) = [ln for ln in lines if re.match(rf"node 0: {stage} on Ray node \w+ at ", ln)]
    found = re.search(r"on Ray node (\w+) at \S+ \(pid (\d+)\)", line)
    assert found, line
    return found[1], int(found[2])


def test_shard_on_ray_gives_the_local_shard_set_byte_for_byte_from_pieces_read_on_both_nodes(
    ray_cluster, sharded_here, tmp_path
):
    corpus, here, address = sharded_here
    cfg = _cfg(tmp_path, corpus, **{"launch.backend": "ray", "launch.ray.address": ray_cluster.address})
    lines: list[str] = []
    result = launch(ShardSpec(config=cfg), on_line=lines.append)

    assert isinstance(result, ShardResult) and not result.reused
    assert result.shards.address == address
    _same_shard_sets(address, here, cfg.store)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(result.ray_nodes) == ROW_GROUPS and set(result.ray_nodes) == alive  # every piece, both nodes
    node, pid = _stage_line(lines, "shard")
    assert node in alive and pid != os.getpid()
    assert ray_leftovers("smoke") == ([], [])


def test_a_node_lost_while_sharding_on_ray_ends_with_the_uninterrupted_manifest(ray_cluster, sharded_here, tmp_path):
    """A third node pauses every piece it gets (LMYARD_FAULTS in its environment only); it is removed while one
    pauses, and Ray runs that piece again on another node."""
    corpus, here, address = sharded_here
    fired = tmp_path / "fired"
    faults = ",".join(f"pause_piece@{i}" for i in range(ROW_GROUPS))
    env = {"LMYARD_FAULTS": faults, "LMYARD_FAULT_PAUSE_S": "300", "LMYARD_FAULTS_STATE": str(fired)}
    # too little of Ray's `memory` for the stage's coordinator (SHARD_MEMORY): it reads pieces only
    victim = ray_cluster.add_node(num_cpus=1, memory=SHARD_MEMORY // 2, env_vars=env)
    ray_cluster.wait_for_nodes()
    run_name = "lost-shard"
    sets = {"run_name": run_name, "launch.backend": "ray", "launch.ray.address": ray_cluster.address}
    cfg = _cfg(tmp_path, corpus, **sets)
    outcome: list = []
    # the stage in a thread: Ray removes a node from the main thread only
    thread = threading.Thread(target=lambda: outcome.append(launch(ShardSpec(config=cfg), on_line=lambda s: None)))
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while not (fired.exists() and any(fired.iterdir())) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fired.exists() and any(fired.iterdir()), "no piece reached the third node"
        assert victim.node_id not in {a["Address"]["NodeID"] for a in ray_actors(run_name)}
    finally:
        _remove_and_wait(ray_cluster, victim)
    thread.join(timeout=600)
    assert outcome, "the stage did not finish"
    result = outcome[0]
    assert isinstance(result, ShardResult) and result.shards.address == address
    assert len(result.ray_nodes) == ROW_GROUPS and victim.node_id not in result.ray_nodes  # read again elsewhere
    _same_shard_sets(address, here, cfg.store)
    assert ray_leftovers(run_name) == ([], [])


def _remove_and_wait(cluster, node) -> None:
    """Remove `node` abruptly and wait (at most 120 s) until the cluster counts it dead: Ray learns of a node
    removed so from its missed heartbeats, and until then it may place the next test's actors there."""
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 120
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)


def test_evaluate_and_export_on_ray_run_on_a_cluster_node_not_in_this_process(ray_cluster, sharded_here, tmp_path):
    from lmyard.data.shards import load_manifest

    corpus, here, address = sharded_here
    write_random_checkpoint(Path(here), step=5, run="r")  # a tiny GPT-2 of the bytes tokenizer, beside the shards
    sets = {"run_name": "r", "store": here, "launch.backend": "ray", "launch.ray.address": ray_cluster.address}
    cfg = _cfg(tmp_path, corpus, **sets)
    shards = load_manifest(open_store(here), address)
    assert shards is not None
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    lines: list[str] = []

    evaluated = launch(EvalSpec(config=cfg, shards=shards, step=5), on_line=lines.append)
    assert isinstance(evaluated, EvalResult) and evaluated.step == 5 and evaluated.device == "cpu"
    node, pid = _stage_line(lines, "evaluate")
    assert node in alive and pid != os.getpid()

    lines.clear()
    spec = ExportSpec(config=cfg, source=f"{here}/runs/r", dest=str(tmp_path / "hf"))
    exported = launch(spec, on_line=lines.append)
    assert isinstance(exported, ExportResult) and exported.step == 5
    assert (tmp_path / "hf" / "model.safetensors").exists()
    node, pid = _stage_line(lines, "export")
    assert node in alive and pid != os.getpid()
    assert {a["Address"]["NodeID"] for a in ray_actors("r")} <= alive
    assert ray_leftovers("r") == ([], [])


def test_an_evaluation_on_cuda_the_cluster_has_no_gpu_for_fails_in_one_line_naming_it(
    ray_cluster, sharded_here, tmp_path
):
    sets = {"launch.backend": "ray", "eval.device": "cuda:0", "run_name": "nogpu"}
    cfg = _cfg(tmp_path, sharded_here[0], **{**sets, "launch.ray.address": ray_cluster.address})
    shards = {"address": "none", "uri": "none", "manifest": {}}
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        launch(EvalSpec.model_validate({"config": cfg, "shards": shards}), on_line=lambda s: None)
    assert time.monotonic() - t0 < 60 and "\n" not in str(e.value)
    assert re.match(
        r"launch.ray: the Ray cluster can never place the evaluate stage: 0 of its \d+ nodes have GPU", str(e.value)
    )
    assert "set eval.device=cpu" in str(e.value)
    assert ray_leftovers("nogpu") == ([], [])
