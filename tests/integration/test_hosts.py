"""Training across simulated hosts (tests/hosts.py): network namespaces joined by a bridge, each host with its
own hostname, address, LMYARD_CACHE and Docker engine; a services host with the image registry.

Skipped where namespaces cannot be made (not root, no `ip`); .ci/run sets LMYARD_REQUIRE_HOSTS=1, which turns
the skip into a failure.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_docker
from conftest import REPO, S3Server, tiny_overrides
from hosts import REGISTRY_PORT, SUBNET, Host, Hosts, require_hosts

from lmyard.errors import UserError
from lmyard.recipes import load_recipe
from lmyard.run import Run

pytestmark = pytest.mark.slow
S3_PORT, MLFLOW_PORT = 5001, 5002
WATCHDOG_S = (
    45  # launch.watchdog_s of the link-cut test: above a step, an evaluation and a checkpoint on a busy machine
)
NO_MEMLOCK = test_docker.NO_MEMLOCK
docker_client, stage_image = test_docker.docker_client, test_docker.stage_image  # fixtures: the stage image built here


def _require(docker: bool = False, registry: bool = False) -> None:
    require_hosts(docker, registry)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Hosts a and b with their own engines, and the services host with the registry; for this module.
    Its teardown checks that nothing of it is left."""
    _require(docker=True, registry=True)
    harness = Hosts(tmp_path_factory.mktemp("hosts"), ["a", "b"], docker=True, registry=True)
    with harness:
        yield harness
    assert harness.leftovers() == []


def test_each_host_has_its_own_name_address_and_cache_and_reaches_the_others(hosts):
    seen = {}
    for host in hosts.hosts:
        out = host.run(["sh", "-c", 'hostname; ip -o -4 addr show dev eth0; echo "$LMYARD_CACHE"'])
        assert out.returncode == 0, out.stderr
        name, addr, cache = out.stdout.splitlines()
        seen[name] = addr.split()[3]
        assert cache == str(host.cache)
        # the registry on the services host answers from every host
        reach = f"import urllib.request; print(urllib.request.urlopen('http://{hosts.registry}/v2/').status)"
        assert host.run(["python3", "-c", reach]).stdout.strip() == "200"
    assert seen == {"host-a": f"{SUBNET}.2/24", "host-b": f"{SUBNET}.3/24"}


def test_the_root_namespace_gets_no_test_address_and_reaches_services_only_through_a_forward(hosts):
    import subprocess
    import urllib.request

    assert f"inet {SUBNET}." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    port = hosts.forward(hosts.services, 5000)
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=10).status == 200


def test_each_host_engine_starts_empty_and_names_its_host(hosts):
    for host in hosts.hosts:
        with contextlib.closing(host.docker()) as client:
            info = client.info()
            assert info["Name"] == host.hostname
            assert info["DockerRootDir"].startswith(str(host.root))
            assert client.images.list() == []  # nothing but what comes through the registry, later


def test_teardown_leaves_no_namespace_link_engine_or_mount_even_after_a_failure(tmp_path):
    _require(docker=True)
    harness = Hosts(tmp_path, ["x"], docker=True)
    with pytest.raises(RuntimeError, match="boom"), harness:
        host = harness["x"]
        assert harness.leftovers()  # namespaces and the engine are there while it runs
        with contextlib.closing(host.docker()) as client:
            client.ping()
        raise RuntimeError("boom")
    assert harness.leftovers() == []
    assert host.dockerd is not None and host.dockerd.poll() is not None


# ---------------------------------------------------------------- the stage image through the registry


@pytest.fixture(scope="module")
def pushed(hosts, stage_image):
    """The session's stage image pushed from this machine's engine to the registry on the services host, through
    a forward on 127.0.0.1 (Docker takes 127.0.0.0/8 registries as insecure); the digest reference under the
    name the hosts know the registry by: the same content, the same digest."""
    from lmyard.launch.images import push_image

    port = hosts.forward(hosts.services, REGISTRY_PORT)
    t0 = time.perf_counter()
    ref = push_image(stage_image, f"127.0.0.1:{port}", log=lambda s: None)
    print(f"pushed {ref} in {time.perf_counter() - t0:.0f} s")
    return f"{hosts.registry}/{ref.split('/', 1)[1]}"


def test_a_push_to_a_registry_nobody_answers_at_is_one_line_and_exit_2_and_leaves_no_tag(stage_image, docker_client):
    import subprocess

    from conftest import free_port

    registry = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "lmyard.launch.images", "build", "--push", registry],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"to the registry {registry} failed" in done.stderr, done.stderr
    assert not [t for img in docker_client.images.list() for t in img.tags if t.startswith(registry)]


def test_each_engine_pulls_the_stage_image_from_the_registry_pinned_to_its_digest(
    hosts,
    pushed,
    stage_image,
    docker_client,
):
    from lmyard.launch.images import ensure_images

    clients = {h.docker_url: h.docker() for h in hosts.hosts}
    said: list[str] = []
    t0 = time.perf_counter()
    try:
        # by tag: node 0's engine reads the digest from the registry, every engine pulls that digest
        ref, images = ensure_images(
            clients,
            f"{hosts.registry}/{stage_image}",
            {h.docker_url: [i] for i, h in enumerate(hosts.hosts)},
            said.append,
        )
        print(f"both engines pulled in {time.perf_counter() - t0:.0f} s")
        assert ref == pushed and "@sha256:" in ref
        built = docker_client.images.get(stage_image).id
        for h in hosts.hosts:  # the same image (config digest) as the one built here, on engines that started empty
            assert images[h.docker_url].id == built
            assert pushed in images[h.docker_url].attrs["RepoDigests"]
        assert sorted(s.split(":")[0] for s in said) == ["nodes 0 on unix", "nodes 1 on unix"]  # both pulled
        # once there, nothing is pulled again
        said.clear()
        assert (
            ensure_images(clients, ref, {h.docker_url: [i] for i, h in enumerate(hosts.hosts)}, said.append)[0] == ref
        )
        assert said == []
    finally:
        for c in clients.values():
            c.close()


def _ours(host: Host) -> list:
    with contextlib.closing(host.docker()) as client:
        return client.containers.list(all=True, filters={"label": "lmyard.run_name"})


@pytest.mark.parametrize(
    ("image_sets", "says"),
    [
        (["launch.docker.registry={svc}:5999"], "cannot read {svc}:5999/lmyard-stage:"),  # nothing listens there
        (["launch.docker.image={registry}/lmyard-stage@sha256:" + "0" * 64], "cannot pull {registry}/lmyard-stage@"),
    ],
    ids=["registry-unreachable", "image-missing"],
)
def test_an_engine_that_cannot_get_the_image_is_one_line_naming_it_and_the_registry_before_any_container(
    hosts, tmp_path, image_sets, says
):
    from lmyard.launch.docker_job import run_docker

    a, b = hosts["a"], hosts["b"]
    fill = {"svc": hosts.services.addr, "registry": hosts.registry}
    cfg = load_recipe(
        "smoke",
        [
            *tiny_overrides(tmp_path, run_name="no-image"),
            "launch.backend=docker",
            "launch.nnodes=2",
            "launch.nproc_per_node=1",
            f"launch.docker.nodes=[{a.docker_url}, {b.docker_url}]",
            f"launch.docker.node_addrs=[{a.addr}, {b.addr}]",
            *(s.format(**fill) for s in image_sets),
        ],
    )
    spec = {"config": cfg.model_dump(mode="json"), "shards": {"address": "x", "uri": "x", "manifest": {}}}
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        run_docker(cfg, {**spec, "lineage": None}, on_line=lines.append, flow_run_id="no-image")
    message = str(e.value)
    assert "\n" not in message and e.value.exit_code == 2, message
    assert message.startswith(f"nodes 0 on {a.docker_url}: ") and says.format(**fill) in message, message
    assert time.monotonic() - t0 < 120
    assert not any(line.startswith("node ") for line in lines)  # no container was described, none created
    assert _ours(a) == [] and _ours(b) == []


# ---------------------------------------------------------------- training across the hosts


@dataclass
class Services:
    s3: S3Server  # reached from here through a forward
    env: dict[str, str]  # for processes in the services host and the containers: AWS_* at the S3 address there
    mlflow: str  # the tracking URI the hosts use
    mlflow_here: str  # the same server, from here


@pytest.fixture(scope="module")
def services(hosts):
    """moto's S3 server and an MLflow server (sqlite) in the services host, bound to its address."""
    svc = hosts.services
    s3 = svc.start(
        [sys.executable, "-m", "moto.server", "-H", svc.addr, "-p", str(S3_PORT)],
        "s3.log",
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"},
    )
    mlflow = svc.start(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            svc.addr,
            "--port",
            str(MLFLOW_PORT),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{svc.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(svc.root / "mlartifacts"),
        ],  # fmt: skip
        "mlflow.log",
    )
    svc.wait_for_port(S3_PORT, s3)
    server = S3Server.with_admin(f"http://127.0.0.1:{hosts.forward(svc, S3_PORT)}")
    svc.wait_for_port(MLFLOW_PORT, mlflow, timeout_s=240)
    env = {**server.env, "AWS_ENDPOINT_URL": f"http://{svc.addr}:{S3_PORT}"}
    return Services(
        server, env, f"http://{svc.addr}:{MLFLOW_PORT}", f"http://127.0.0.1:{hosts.forward(svc, MLFLOW_PORT)}"
    )


def _launch(hosts: Hosts, services: Services, tmp: Path, bucket: str, out: Path, **sets) -> list[str]:
    """The command that launches the tiny run on hosts a and b from the services host (tests/launch_on_host.py)."""
    a, b = hosts["a"], hosts["b"]
    overrides = tiny_overrides(
        tmp,
        **{
            "store": f"s3://{bucket}/lmyard",
            "tracking.uri": services.mlflow,
            "launch.backend": "docker",
            "launch.nnodes": 2,
            "launch.nproc_per_node": 1,
            "launch.docker.nodes": f"[{a.docker_url}, {b.docker_url}]",
            "launch.docker.node_addrs": f"[{a.addr}, {b.addr}]",
            "launch.docker.socket_ifname": "eth0",
            "launch.docker.registry": hosts.registry,
            "launch.docker.shm_size": "256m",
            **NO_MEMLOCK,
            **sets,
        },
    )
    launcher = REPO / "tests" / "launch_on_host.py"
    return [sys.executable, str(launcher), str(out), *(f"--set={s}" for s in overrides)]


def test_two_hosts_train_one_node_each_and_end_at_the_val_loss_of_two_local_ranks(
    hosts, services, pushed, tmp_path, monkeypatch
):
    """Host a and host b run one container each, through their own engines, on their hosts' networks; the
    rendezvous is at host a's address; the store is S3 and MLflow a server, both on the services host, where
    the launch runs too. The same config with two ranks on this machine (launch.backend=local) ends at the
    same validation loss within a relative 1e-6, not bitwise: the same torch build (the image's wheel is the
    one installed here) and data, but the image's Python and libraries are Debian's, not this machine's, and
    float32 round-off then differs in the last bits (measured: 1.2e-8 relative at step 6); a wrong gradient
    sync, data order or learning-rate schedule moves it by more than 1e-3."""
    from mlflow.tracking import MlflowClient

    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.launch.local_job import run_local
    from lmyard.stages import TrainSpec
    from lmyard.store import open_store

    a, b = hosts["a"], hosts["b"]
    bucket = services.s3.new_bucket()
    common = {"run_name": "two-hosts", "launch.nproc_per_node": 1}
    out = tmp_path / "launch.json"
    t0 = time.perf_counter()
    ran = hosts.services.run(_launch(hosts, services, tmp_path, bucket, out, **common), env=services.env, timeout=900)
    print(f"two hosts: {time.perf_counter() - t0:.0f} s")
    launched = json.loads(out.read_text()) if out.exists() else {"lines": [ran.stdout, ran.stderr]}
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    result = launched["result"]
    assert result["status"] == "done" and result["step"] == 6, text[-3000:]

    # two containers, at two hosts' names and addresses, the image by digest from the registry
    joined = sorted(
        re.sub(r" \[rank \d+\]", "", line.split(": ranks")[0]) for line in launched["lines"] if "of 2 joined" in line
    )
    assert joined == ["[node 0] host-a", "[node 1] host-b"], text[-3000:]
    described = [line for line in launched["lines"] if line.startswith("node ")]
    assert [f"--local_addr {h.addr}" in line for line, h in zip(described, (a, b), strict=True)] == [True, True]
    assert all(f"--rdzv_endpoint {a.addr}:29400" in line for line in described)
    assert all(f"image={pushed}" in line and "network=host" in line for line in described)
    assert _ours(a) == [] and _ours(b) == []

    # checkpoints in S3 and rank 0's metrics in MLflow, both on the services host
    for k, v in services.s3.env.items():
        monkeypatch.setenv(k, v)
    assert complete_steps(Run("two-hosts", open_store(f"s3://{bucket}/lmyard"))) == [3, 6]
    history = MlflowClient(services.mlflow_here).get_metric_history(launched["mlflow_run_id"], "loss/train")
    assert [m.step for m in history] == list(range(1, 7))

    # the same config, two ranks on this machine
    local = load_recipe("smoke", tiny_overrides(tmp_path / "local", **{**common, "launch.nproc_per_node": 2}))
    shards, _ = tokenize_and_shard(local, log=lambda s: None)
    here = run_local(local, TrainSpec(config=local, shards=shards), on_line=lambda s: None)
    assert here.step == 6 and here.val_loss is not None
    assert result["val_loss"] == pytest.approx(here.val_loss, rel=1e-6), (result["val_loss"], here.val_loss)
    assert result["train_loss"] == pytest.approx(here.train_loss, rel=1e-6), (result["train_loss"], here.train_loss)


def test_host_bs_link_cut_mid_run_is_named_in_one_line_and_the_run_goes_on_on_host_a_without_waiting_for_it(
    hosts, services, pushed, tmp_path, monkeypatch
):
    """launch.min_nnodes=1. Host b's link is cut once step 3 is committed (both ranks pause after step 4, so the cut
    lands before step 5) and stays cut until the run ends: both ranks wait in step 5's all-reduce. The watchdog
    (launch.watchdog_s, far below torch's 30-minute collective timeout) ends the launch; its one line says that no
    step completed and that node 1, host b, cannot reach node 0's rendezvous, asked through each host's engine.
    The run goes on at once on host a alone from step 3, the last committed checkpoint, and finishes there: host b's
    engine still answers, but a host lost to its network is not taken back within the run."""
    import subprocess

    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.store import open_store

    a, b = hosts["a"], hosts["b"]
    bucket = services.s3.new_bucket()
    out = tmp_path / "launch.json"
    sets = {"run_name": "link-cut", "launch.watchdog_s": WATCHDOG_S, "launch.grace_s": 10, "launch.min_nnodes": 1}
    cmd = _launch(hosts, services, tmp_path, bucket, out, **sets)
    faults = {"LMYARD_FAULTS": "pause@4", "LMYARD_FAULT_PAUSE_S": "15"}
    launcher = subprocess.Popen(hosts.services.argv(cmd), env=hosts.services.env({**services.env, **faults}))
    for k, v in services.s3.env.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{bucket}/lmyard")
    try:
        deadline = time.monotonic() + 600
        while not complete_steps(Run("link-cut", store)):
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.5)
        hosts.set_link(b, up=False)
        cut_at = time.time()
        launcher.wait(timeout=WATCHDOG_S + 600)
    finally:
        hosts.set_link(b, up=True)
        if launcher.poll() is None:
            launcher.kill()
    launched = json.loads(out.read_text())
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    assert launched["result"]["status"] == "done" and launched["result"]["step"] == 6, text[-3000:]
    assert _ours(a) == [] and _ours(b) == []

    one, two = _attempts(services, launched["mlflow_run_id"])
    message = (one.outcome or "").removeprefix("resized: lost node 1 (" + b.addr + "): ")
    assert message.startswith("watchdog: no training step completed for") and "\n" not in message, one.outcome
    assert f"node 1 ({b.hostname}, {b.addr}) cannot reach node 0 ({a.hostname}, {a.addr})'s rendezvous" in message
    assert (two.nodes, two.hosts, two.start_step) == (1, f"node 0 ({a.addr})", 3), two  # the last committed step
    assert two.outcome == "finished: step 6"
    resized_at = _said_at(launched, "resize: 2 -> 1 nodes")
    first_step_at = _said_at(launched, "step ", after=resized_at)
    print(f"link cut -> resize: {resized_at - cut_at:.0f} s (the watchdog, the probe, the kill); "
          f"resize -> first step on host a: {first_step_at - resized_at:.0f} s")  # fmt: skip
    assert resized_at - cut_at < WATCHDOG_S + 120  # the watchdog, the probe (5 s), the kill: not torch's 30 minutes
    assert complete_steps(Run("link-cut", store)) == [3, 6]


def _attempts(services: Services, run_id: str) -> list:
    from mlflow.tracking import MlflowClient

    from lmyard.tracking.runs import _attempts

    return _attempts(MlflowClient(services.mlflow_here).get_run(run_id).data.tags)


def _said_at(launched: dict, starts: str, after: float = 0.0) -> float:
    """When the launch first said a line starting with `starts` (after time `after`)."""
    return next(t for t, line in zip(launched["times"], launched["lines"]) if t > after and line.startswith(starts))


def test_host_bs_engine_lost_mid_run_goes_on_on_host_a_and_grows_back_to_both_hosts_when_it_returns(
    hosts, services, pushed, tmp_path, monkeypatch
):
    """launch.min_nnodes=1 on two hosts. Host b's engine stops once step 3 is committed (every rank pauses after step
    4, so nothing later is committed on two hosts): the launch goes on at once on host a alone, from step 3, one
    rank with twice the accumulation. Once step 6 is committed there, host b's engine starts again: the run commits
    the step it is at, stops and relaunches on both hosts from that step (every rank pauses after step 8, a window
    for it), and finishes. The lineage's attempts say each size, its hosts, why it changed, and the steps trained
    at each; the committed steps follow one another with none lost or trained twice.

    Its final val loss equals two local ranks' within a relative 2e-4, the world-size resume test's tolerance
    (tests/integration/test_trainer_integration.py): the steps on one rank sum the same micro-batches of the same
    global batch in another float order; a lost or repeated step, a wrong data order or batch moves it by more
    than 1e-3."""
    import subprocess

    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.launch.local_job import run_local
    from lmyard.stages import TrainSpec
    from lmyard.store import open_store

    a, b = hosts["a"], hosts["b"]
    bucket = services.s3.new_bucket()
    out = tmp_path / "launch.json"
    common = {"run_name": "elastic", "train.max_steps": 12, "launch.nproc_per_node": 1, "eval.interval": 6}
    sets = {**common, "launch.min_nnodes": 1, "launch.grace_s": 10}
    cmd = _launch(hosts, services, tmp_path, bucket, out, **sets)
    faults = {"LMYARD_FAULTS": "pause@4,pause@8", "LMYARD_FAULT_PAUSE_S": "20"}
    launcher = subprocess.Popen(hosts.services.argv(cmd), env=hosts.services.env({**services.env, **faults}))
    for k, v in services.s3.env.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{bucket}/lmyard")

    def wait_for_step(step: int) -> list[int]:
        deadline = time.monotonic() + 600
        while step not in (done := complete_steps(Run("elastic", store))):
            assert launcher.poll() is None and time.monotonic() < deadline, f"step {step} was never committed"
            time.sleep(0.5)
        return done

    try:
        assert wait_for_step(3) == [3]
        b.stop_dockerd()  # what `systemctl stop docker` does: the engine stops its container, then exits
        lost_at = time.time()
        wait_for_step(6)  # committed on host a alone
        b.restart_dockerd()
        launcher.wait(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if b.dockerd is None or b.dockerd.poll() is not None:
            b.restart_dockerd()  # the next tests need host b's engine
    launched = json.loads(out.read_text())
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    result = launched["result"]
    assert result["status"] == "done" and result["step"] == 12, text[-3000:]
    assert _ours(a) == [] and _ours(b) == []

    # the loss of host b to the first step on host a alone, in parts
    resized_at = _said_at(launched, "resize: 2 -> 1 nodes")
    first_step_at = _said_at(launched, "step ", after=resized_at)
    print(f"host b lost -> resize: {resized_at - lost_at:.1f} s; resize -> first step on host a: "
          f"{first_step_at - resized_at:.1f} s")  # fmt: skip
    from lmyard.launch.job import RDZV_TIMEOUT_S

    assert first_step_at - lost_at < 10 + RDZV_TIMEOUT_S  # launch.grace_s + the rendezvous timeout

    one, two, three = _attempts(services, launched["mlflow_run_id"])
    assert (one.nodes, one.hosts, one.start_step, one.steps) == (2, f"node 0 ({a.addr}), node 1 ({b.addr})", 0, 3)
    assert one.outcome and one.outcome.startswith(f"resized: lost node 1 ({b.addr})"), one.outcome
    assert (two.nodes, two.hosts, two.start_step) == (1, f"node 0 ({a.addr})", 3)  # the last committed step
    assert two.resized and two.resized.startswith(f"lost node 1 ({b.addr})"), two.resized
    assert two.outcome and two.outcome.startswith("resized: grew back"), two.outcome
    grew_at = two.start_step + two.steps
    assert (three.nodes, three.start_step, three.steps) == (2, grew_at, None), three
    assert three.resized == f"grew back: node 1 ({b.addr}) healthy again" and three.outcome == "finished: step 12"
    committed = complete_steps(Run("elastic", store))
    assert grew_at >= 6 and grew_at in committed and committed[-1] == 12, committed  # grown at a committed step

    # the same config, two ranks on this machine, uninterrupted
    local = load_recipe("smoke", tiny_overrides(tmp_path / "local", **{**common, "launch.nproc_per_node": 2}))
    shards, _ = tokenize_and_shard(local, log=lambda s: None)
    here = run_local(local, TrainSpec(config=local, shards=shards), on_line=lambda s: None)
    assert here.step == 12 and here.val_loss is not None
    assert result["val_loss"] == pytest.approx(here.val_loss, rel=2e-4), (result["val_loss"], here.val_loss)


def test_host_bs_engine_stopping_mid_run_fails_the_launch_naming_node_1_and_leaves_nothing_on_host_a(
    hosts, services, pushed, tmp_path, monkeypatch
):
    """Last in this module: host b's engine does not come back."""
    import subprocess

    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.store import open_store

    a, b = hosts["a"], hosts["b"]
    bucket = services.s3.new_bucket()
    out = tmp_path / "launch.json"
    # launch.grace_s: how long node 0 is given to end on its own after node 1 failed, before it is stopped
    sets = {"run_name": "engine-stops", "train.max_steps": 5000, "launch.grace_s": 10}
    cmd = _launch(hosts, services, tmp_path, bucket, out, **sets)
    launcher = subprocess.Popen(hosts.services.argv(cmd), env=hosts.services.env(services.env))
    for k, v in services.s3.env.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{bucket}/lmyard")
    try:
        deadline = time.monotonic() + 600
        while not complete_steps(Run("engine-stops", store)):  # training runs on both hosts
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(1)
        t0 = time.monotonic()
        assert len(_ours(a)) == len(_ours(b)) == 1
        b.stop_dockerd()  # what `systemctl stop docker` does: the engine stops its containers, then exits
        launcher.wait(timeout=600)
        print(f"the launch ended {time.monotonic() - t0:.0f} s after host b's engine stopped")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    launched = json.loads(out.read_text())
    assert "result" not in launched, launched["result"]
    message = launched["error"]
    print(f"the launch failed: {message.splitlines()[0]}")
    assert launched["error_type"] == "TrainingFailed" and "node 1" in message, message
    assert message.splitlines()[0].startswith(("lost node 1", "node 1")), message
    assert _ours(a) == []  # host a's container removed; host b's engine is gone
    assert complete_steps(Run("engine-stops", store))  # the checkpoint written before is kept
