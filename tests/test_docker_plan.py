"""The Docker launcher's container definitions: devices, networks, NCCL settings, mounts, credentials.

GPU containers cannot run here; these check what the launcher asks each engine for.
"""

from __future__ import annotations

import json

import pytest

from lmyard.config import load_recipe
from lmyard.errors import UserError
from lmyard.launch.containers import connect, describe, plan

SPEC = {"config": None, "shards": {"address": "a", "uri": "file:///s/shards/a", "manifest": {}}, "lineage": None}
ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLEKEY",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t-value-123",
    "HOME": "/root",
    "MLFLOW_TRACKING_TOKEN": "tok-abcdef",
    "UNRELATED": "x",
}


def _plan(tmp_path, *sets, environ=ENV, **kw):
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", "launch.backend=docker", *sets])
    spec = {**SPEC, "config": cfg.model_dump(mode="json")}
    return cfg, plan(cfg, spec, image="lmyard-stage:test", environ=environ, launch_id="abc123", **kw)


def test_gpu_nodes_request_gpus_use_host_networking_and_name_the_nccl_interface(tmp_path):
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.nproc_per_node=8",
        "launch.docker.gpus=8",
        "launch.docker.socket_ifname=eth0",
        "launch.docker.nodes=[tcp://gpu-a:2376, tcp://gpu-b:2376]",
        "launch.docker.env={NCCL_IB_HCA: mlx5, NCCL_DEBUG: WARN}",
    )
    assert [n.url for n in p.nodes] == ["tcp://gpu-a:2376", "tcp://gpu-b:2376"]
    for i, node in enumerate(p.nodes):
        k = node.kwargs
        (req,) = k["device_requests"]
        assert req["Count"] == 8 and req["Capabilities"] == [["gpu"]] and not req.get("DeviceIDs")
        assert k["network_mode"] == "host" and "network" not in k
        env = k["environment"]
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_DEBUG"] == "WARN"
        cmd = k["command"]
        # rendezvous on node 0's host, which only node 0 hosts
        assert cmd[cmd.index("--rdzv_endpoint") + 1] == "gpu-a:29400"
        assert f"is_host={int(i == 0)}" in cmd[cmd.index("--rdzv_conf") + 1]
        assert cmd[cmd.index("--nproc_per_node") + 1] == "8" and cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[cmd.index("--rdzv_id") + 1] == "abc123"
        assert cmd[cmd.index("--local_addr") + 1] == ["gpu-a", "gpu-b"][i]
        assert {u["Name"]: (u["Soft"], u["Hard"]) for u in k["ulimits"]} == {
            "memlock": (-1, -1),
            "stack": (64 << 20, 64 << 20),
        }
        assert k["shm_size"] == "16g"
        assert k["labels"]["lmyard.node"] == str(i)


def test_all_gpus_and_gpu_ids_become_device_requests(tmp_path):
    _, p = _plan(tmp_path, "launch.docker.gpus=all")
    assert p.nodes[0].kwargs["device_requests"][0]["Count"] == -1
    _, p = _plan(tmp_path, "launch.docker.gpu_ids=['0', '3']")
    req = p.nodes[0].kwargs["device_requests"][0]
    assert req["DeviceIDs"] == ["0", "3"] and req["Capabilities"] == [["gpu"]]
    _, p = _plan(tmp_path)
    assert "device_requests" not in p.nodes[0].kwargs


def test_an_explicit_rendezvous_endpoint_wins_over_node_zeros_url(tmp_path):
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.rdzv_endpoint=10.1.2.3:29500",
        "launch.docker.nodes=[ssh://ops@gpu-a, ssh://ops@gpu-b]",
    )
    cmd = p.nodes[1].kwargs["command"]
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == "10.1.2.3:29500"


def test_nodes_sharing_a_local_engine_on_host_networking_get_distinct_loopback_addresses(tmp_path):
    # torchrun is pid 1 in every container and they share the host's name: the rendezvous needs another id
    _, p = _plan(tmp_path, "launch.nnodes=3")
    addrs = [n.kwargs["command"][n.kwargs["command"].index("--local_addr") + 1] for n in p.nodes]
    assert addrs == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    cmd = p.nodes[2].kwargs["command"]
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == "127.0.0.1:29400"


def test_bridge_network_puts_the_rendezvous_on_node_zeros_container_name(tmp_path):
    _, p = _plan(tmp_path, "launch.nnodes=2", "launch.docker.network=bridge", flow_run_id="fr-1")
    assert p.network and p.network.endswith("-net")
    names = [n.kwargs["name"] for n in p.nodes]
    assert all(n.kwargs["network"] == p.network and "network_mode" not in n.kwargs for n in p.nodes)
    assert [n.kwargs["hostname"] for n in p.nodes] == names
    cmd = p.nodes[1].kwargs["command"]
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == f"{names[0]}:29400" and "--local_addr" not in cmd
    assert p.labels == {
        "lmyard.run_name": "smoke",
        "lmyard.flow_run_id": "fr-1",
        "lmyard.launch_id": "abc123",
        "lmyard.stage": "train",
    }


def test_bridge_across_engines_and_wrong_node_counts_are_refused():
    with pytest.raises(UserError, match="needs every node on one engine"):
        load_recipe(
            "smoke",
            [
                "launch.backend=docker",
                "launch.nnodes=2",
                "launch.docker.network=bridge",
                "launch.docker.nodes=[tcp://a:2376, tcp://b:2376]",
            ],
        )
    with pytest.raises(UserError, match="lists 3 engines for launch.nnodes=2"):
        load_recipe(
            "smoke",
            ["launch.backend=docker", "launch.nnodes=2", "launch.docker.nodes=[unix:///a, unix:///b, unix:///c]"],
        )
    with pytest.raises(UserError, match="several nodes on one remote engine with host networking"):
        load_recipe("smoke", ["launch.backend=docker", "launch.nnodes=2", "launch.docker.nodes=[tcp://a:2376]"])
    with pytest.raises(UserError, match="gpus or launch.docker.gpu_ids, not both"):
        load_recipe("smoke", ["launch.docker.gpus=2", "launch.docker.gpu_ids=['0']"])


def test_credentials_reach_the_environment_but_never_the_description(tmp_path):
    _, p = _plan(tmp_path, "launch.docker.pass_env=[MLFLOW_TRACKING_TOKEN, NOT_SET]")
    node = p.nodes[0]
    env = node.kwargs["environment"]
    assert env["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-value-123" and env["MLFLOW_TRACKING_TOKEN"] == "tok-abcdef"
    assert "UNRELATED" not in env and "HOME" not in env and "NOT_SET" not in env
    text = describe(node)
    for secret in ("AKIDEXAMPLEKEY", "s3cr3t-value-123", "tok-abcdef"):
        assert secret not in text
    assert "'AWS_SECRET_ACCESS_KEY': '***'" in text
    assert "s3cr3t" not in json.dumps(json.loads(env["LMYARD_SPEC"]))  # the spec holds no credentials


def test_a_local_store_and_sqlite_tracking_are_mounted_at_their_own_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe("smoke", ["store=rel/store", "launch.backend=docker"])
    lineage = {"tracking_uri": "sqlite:///db/mlflow.db", "mlflow_run_id": "r", "run_name": "smoke"}
    lineage |= {"experiment_id": "1", "attempt": 1, "resumed_from": None, "start_step": 0}
    p = plan(
        cfg,
        {**SPEC, "config": cfg.model_dump(mode="json"), "lineage": lineage},
        image="i",
        environ={},
        launch_id="x",
    )
    k = p.nodes[0].kwargs
    store, db_dir = str(tmp_path / "rel" / "store"), str(tmp_path / "db")
    assert k["volumes"][store] == {"bind": store, "mode": "rw"}
    assert k["volumes"][db_dir] == {"bind": db_dir, "mode": "rw"}
    spec = json.loads(k["environment"]["LMYARD_SPEC"])
    assert spec["config"]["store"] == store
    assert spec["lineage"]["tracking_uri"] == f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}"
    assert lineage["tracking_uri"] == "sqlite:///db/mlflow.db"  # the caller's spec is not changed
    # one node: torchrun standalone, no rendezvous endpoint
    assert "--standalone" in k["command"] and "--rdzv_endpoint" not in k["command"]


def test_an_s3_store_mounts_nothing(tmp_path):
    _, p = _plan(tmp_path, "store=s3://bucket/prefix")
    assert p.nodes[0].kwargs["volumes"] == {}


def test_a_tcp_engine_without_tls_certificates_is_refused(monkeypatch):
    monkeypatch.delenv("DOCKER_CERT_PATH", raising=False)
    cfg = load_recipe("smoke", ["launch.backend=docker"])
    with pytest.raises(UserError, match="tcp:// engine needs TLS"):
        connect("tcp://gpu-a:2376", cfg.launch.docker)
