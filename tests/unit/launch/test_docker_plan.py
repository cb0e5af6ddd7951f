"""The Docker launcher's container definitions: devices, networks, NCCL settings, mounts, credentials.

GPU containers cannot run here; these check what the launcher asks each engine for.
"""

from __future__ import annotations

import json

import pytest

from lmyard.errors import UserError
from lmyard.launch.docker_job import connect, describe, plan
from lmyard.recipes import load_recipe

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


# ---------------------------------------------------------------- launch.docker.gpu_mode (lmyard.launch.gpus)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_toolkit_mode_keeps_the_gpu_device_request_and_private_namespaces_on_separate_hosts(tmp_path):
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.docker.nodes=[tcp://gpu-a:2376, tcp://gpu-b:2376]",
        "launch.docker.node_gpus=['0,1', '2,3']",
    )
    for node, ids in zip(p.nodes, (["0", "1"], ["2", "3"])):
        k = node.kwargs
        (req,) = k["device_requests"]
        assert req["DeviceIDs"] == ids and req["Capabilities"] == [["gpu"]] and req["Driver"] == ""
        assert "pid_mode" not in k and "ipc_mode" not in k and "devices" not in k and k["shm_size"] == "16g"
        assert "CUDA_VISIBLE_DEVICES" not in k["environment"]
        assert NO_MULTICAST.items() <= k["environment"].items()


def test_devices_mode_gives_nodes_sharing_a_host_every_gpu_their_own_visible_and_host_namespaces(tmp_path):
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.docker.gpu_mode=devices",
        "launch.docker.node_gpus=['0,1', '2,3']",
        "launch.docker.driver_dir=/opt/nvidia-driver",
    )
    for node, visible in zip(p.nodes, ("0,1", "2,3")):
        k = node.kwargs
        assert k["devices"] == [
            f"{d}:{d}:rwm"
            for d in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
            + [f"/dev/nvidia{g}" for g in range(4)]
        ]
        (mount,) = k["mounts"]
        assert (mount["Source"], mount["Target"], mount["Type"], mount["ReadOnly"]) == (
            "/opt/nvidia-driver",
            "/opt/nvidia-driver",
            "bind",
            True,
        )
        env = k["environment"]
        assert env["CUDA_VISIBLE_DEVICES"] == visible and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["LD_LIBRARY_PATH"] == "/opt/nvidia-driver/lib64"
        assert NO_MULTICAST.items() <= env.items()
        assert k["pid_mode"] == "host" and k["ipc_mode"] == "host" and "shm_size" not in k
        assert "device_requests" not in k
        assert k["network_mode"] == "host"


def test_devices_mode_on_separate_hosts_gives_each_node_only_its_gpus(tmp_path):
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.docker.nodes=[ssh://ops@gpu-a, ssh://ops@gpu-b]",
        "launch.docker.gpu_mode=devices",
        "launch.docker.gpus=2",
        "launch.docker.env={NCCL_NVLS_ENABLE: '1', LD_LIBRARY_PATH: /mine}",
    )
    for node in p.nodes:
        k = node.kwargs
        assert [d.split(":")[0] for d in k["devices"]][3:] == ["/dev/nvidia0", "/dev/nvidia1"]
        assert "pid_mode" not in k and "CUDA_VISIBLE_DEVICES" not in k["environment"]
        # the user's launch.docker.env wins over the GPU defaults
        assert k["environment"]["NCCL_NVLS_ENABLE"] == "1" and k["environment"]["LD_LIBRARY_PATH"] == "/mine"
        assert k["environment"]["NVSHMEM_DISABLE_NVLS"] == "1"


def test_cdi_mode_asks_for_cdi_device_names(tmp_path):
    _, p = _plan(tmp_path, "launch.nnodes=2", "launch.docker.gpu_mode=cdi", "launch.docker.node_gpus=['0', '1']")
    for node, visible in zip(p.nodes, ("0", "1")):
        (req,) = node.kwargs["device_requests"]
        assert req["Driver"] == "cdi" and req["DeviceIDs"] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
        assert node.kwargs["environment"]["CUDA_VISIBLE_DEVICES"] == visible
        assert node.kwargs["pid_mode"] == "host" and "devices" not in node.kwargs
    _, p = _plan(tmp_path, "launch.docker.gpu_mode=cdi", "launch.docker.gpus=all")
    assert p.nodes[0].kwargs["device_requests"][0]["DeviceIDs"] == ["nvidia.com/gpu=all"]


def test_cpu_nodes_get_no_gpu_settings_in_any_mode(tmp_path):
    _, p = _plan(tmp_path, "launch.nnodes=2", "launch.docker.gpu_mode=devices")
    for node in p.nodes:
        k = node.kwargs
        assert not {"devices", "mounts", "device_requests", "pid_mode", "ipc_mode"} & k.keys()
        assert not NO_MULTICAST.keys() & k["environment"].keys() and k["shm_size"] == "16g"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["launch.nnodes=2", "launch.docker.node_gpus=['0,1', '2,3', '4']"],
            "node_gpus lists 3 entries for launch.nnodes=2",
        ),
        (
            ["launch.nnodes=2", "launch.docker.node_gpus=['0,1', '1,2']"],
            "nodes 0 and 1 share the engine .* both use GPU 1",
        ),
        (["launch.nnodes=2", "launch.docker.gpu_ids=['0']"], "nodes 0 and 1 share the engine .* both use GPU 0"),
        (["launch.nnodes=2", "launch.docker.gpu_mode=devices", "launch.docker.gpus=1"], "both use GPU 0"),
    ],
)
def test_per_node_gpus_that_do_not_fit_the_nodes_are_refused_in_one_line(tmp_path, sets, message):
    with pytest.raises(UserError, match=message) as e:
        _plan(tmp_path, *sets)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["launch.docker.gpus=2", "launch.docker.node_gpus=['0']"], "one of launch.docker.gpus, gpu_ids, node_gpus"),
        (["launch.docker.node_gpus=['0', '']"], "node_gpus has an empty entry"),
        (["launch.docker.gpu_mode=devices", "launch.docker.gpus=all"], "gpu_mode=devices needs GPU indices"),
        (["launch.docker.gpu_mode=devices", "launch.docker.gpu_ids=['GPU-1a2b']"], "by index .* not 'GPU-1a2b'"),
        (["launch.docker.gpu_mode=gpus"], "gpu_mode"),
    ],
)
def test_gpu_settings_that_contradict_each_other_are_refused_when_the_config_loads(sets, message):
    with pytest.raises(UserError, match=message):
        load_recipe("smoke", ["launch.backend=docker", *sets])


def test_node_addresses_are_each_nodes_local_address_and_node_zeros_the_rendezvous(tmp_path):
    # engines on local sockets of simulated hosts (or a management network): their URLs say nothing of the
    # addresses the nodes reach each other at
    _, p = _plan(
        tmp_path,
        "launch.nnodes=2",
        "launch.docker.nodes=[unix:///run/a.sock, unix:///run/b.sock]",
        "launch.docker.node_addrs=[10.0.0.2, 10.0.0.3]",
    )
    for node, addr in zip(p.nodes, ["10.0.0.2", "10.0.0.3"], strict=True):
        cmd = node.kwargs["command"]
        assert cmd[cmd.index("--local_addr") + 1] == addr
        assert cmd[cmd.index("--rdzv_endpoint") + 1] == "10.0.0.2:29400"
        assert "pid_mode" not in node.kwargs and node.kwargs["network_mode"] == "host"
    with pytest.raises(ValueError, match="node_addrs lists 1 addresses for launch.nnodes=2"):
        _plan(tmp_path, "launch.nnodes=2", "launch.docker.node_addrs=[10.0.0.2]")
