"""Stages in containers on a real Docker engine: the stage image, 2-node training, failure, cancellation.

The image is built once per session (or reused: its tag follows the sources). Skipped only when no
engine answers; .ci/run starts one and sets LMYARD_REQUIRE_DOCKER=1, which turns the skip into a failure.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import threading
import time

import pytest
from conftest import free_port, tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.launch.docker_job import remove_leftovers, run_docker
from lmyard.launch.local_job import run_local
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.stages import EvalResult, EvalSpec, ExportResult, ExportSpec, ShardResult, ShardSpec, TrainSpec
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage

pytestmark = pytest.mark.slow
IMAGE_UID = 1000  # the stage image's non-root user
# This sandbox's engine lacks CAP_SYS_RESOURCE: it cannot raise memlock to the production default (unlimited).
NO_MEMLOCK = {"launch.docker.ulimits": "{stack: 67108864}"}
NO_MEMLOCK_SET = [f"{k}={v}" for k, v in NO_MEMLOCK.items()]


@pytest.fixture(scope="session")
def docker_client():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as e:
        if os.environ.get("LMYARD_REQUIRE_DOCKER") == "1":
            pytest.fail(f"LMYARD_REQUIRE_DOCKER=1 but no Docker engine answers: {e}")
        pytest.skip(f"no Docker engine answers ({e}); start dockerd to run these tests")
    yield client
    client.close()


@pytest.fixture(scope="session")
def stage_image(docker_client):
    from lmyard.launch.images import build_image

    t0 = time.perf_counter()
    tag = build_image(log=lambda s: None)
    print(f"stage image {tag} ready in {time.perf_counter() - t0:.0f} s")
    return tag


def _ours(client, run_name: str) -> tuple[list, list]:
    sel = {"label": f"lmyard.run_name={run_name}"}
    return client.containers.list(all=True, filters=sel), client.networks.list(filters=sel)


def _writable_by_image(path):
    path.mkdir(parents=True, exist_ok=True)
    for p in [path, *path.rglob("*")]:
        os.chown(p, IMAGE_UID, IMAGE_UID)
    return path


def test_image_runs_as_a_non_root_user_with_torchs_bytecode_and_is_labelled_with_its_sources(
    docker_client, stage_image
):
    from lmyard.launch.images import SOURCE_LABEL, source_digest

    # the user cannot write bytecode: without the image's, every rank would compile torch's modules at its start
    check = "import os, torch, lmyard.train.stage as s; print(os.path.exists(torch.__cached__), os.path.exists(s.__cached__))"
    cmd = f"id -u; echo $LMYARD_CODE_VERSION; python -c '{check}'"
    out = docker_client.containers.run(stage_image, ["sh", "-c", cmd], remove=True)
    uid, version, torch_pyc, lmyard_pyc = out.decode().split()
    assert uid == str(IMAGE_UID) and version.startswith("0.")
    assert (torch_pyc, lmyard_pyc) == ("True", "True")
    assert docker_client.images.get(stage_image).labels[SOURCE_LABEL] == source_digest()


@pytest.fixture(scope="module")
def image_sharded(docker_client, stage_image, tmp_path_factory):
    """A store sharded by the tokenize stage running in the image; the host reuses that shard set. The built-in
    corpus: the image's Python (another patch release than the host's) reads the same shipped copy, so the
    container's shard set is the host's, address and all."""
    tmp = tmp_path_factory.mktemp("docker")
    (tmp / "store").mkdir()  # mounted by the launcher: made here, or the engine makes it for root
    _writable_by_image(tmp)
    overrides = tiny_overrides(tmp, **{"data.source": "builtin:pydoc-topics", **NO_MEMLOCK})
    cfg = load_recipe("smoke", [*overrides, "launch.backend=docker"])
    lines: list[str] = []
    written = run_docker(cfg, ShardSpec(config=cfg), on_line=lines.append, image=stage_image)
    shards, reused = tokenize_and_shard(cfg, log=lambda s: None)
    return tmp, shards, reused, written


def test_prune_keeps_the_newest_images_and_any_a_container_was_made_from(docker_client, stage_image):
    from lmyard.errors import UserError
    from lmyard.launch.images import prune

    repo = "lmyard-prune-test"
    for i in range(4):  # four small images, oldest first (a label on top of the stage image)
        dockerfile = f"FROM {stage_image}\nLABEL lmyard.test=prune-{i}\n".encode()
        docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=f"{repo}:v{i}", pull=False, rm=True)
    container = docker_client.containers.create(f"{repo}:v0", ["true"])
    said: list[str] = []
    try:
        with pytest.raises(UserError, match="keep at least 1"):
            prune(keep=0, repo=repo)
        assert prune(keep=2, repo=repo, log=said.append) == [f"{repo}:v1"]
        left = sorted(t for img in docker_client.images.list(name=repo) for t in img.tags)
        assert left == [f"{repo}:v0", f"{repo}:v2", f"{repo}:v3"]
        assert f"keeping {repo}:v0: a container was made from it" in said
        assert docker_client.images.get(stage_image)  # another repository is never touched
    finally:
        container.remove(force=True)
        for img in docker_client.images.list(name=repo):
            docker_client.images.remove(img.id, force=True)


def test_tokenize_stage_runs_in_the_image_and_writes_a_shard_set_the_host_reuses(image_sharded):
    tmp, shards, reused, written = image_sharded

    assert reused, "the host found no complete shard set where the container wrote it"
    assert isinstance(written, ShardResult) and not written.reused
    assert written.shards.address == shards.address and written.train_tokens == shards.tokens("train") > 100_000


def test_two_containers_on_a_bridge_network_train_and_checkpoint_to_a_mounted_store(
    docker_client, stage_image, image_sharded
):
    tmp, shards, _, _ = image_sharded
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp,
            steps=12,
            **{
                "data.source": str(tmp / "corpus.jsonl"),
                "run_name": "bridge",
                "launch.backend": "docker",
                "launch.nnodes": 2,
                "launch.nproc_per_node": 1,
                "launch.docker.network": "bridge",
                "launch.docker.shm_size": "256m",
                **NO_MEMLOCK,
                "checkpoint.interval": 4,
                "eval.interval": 6,
                "tracking.uri": f"sqlite:///{tmp / 'mlflow' / 'mlflow.db'}",
                "tracking.system_metrics_interval_s": 0.5,
            },
        ),
    )
    (tmp / "mlflow").mkdir(exist_ok=True)
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address=shards.address, code_version="test")
    lineage = lineage.record_attempt(resumed_from=None, start_step=0, info={})
    _writable_by_image(tmp / "mlflow")
    _writable_by_image(tmp / "store")  # open_lineage wrote runs/bridge/ as this (root) user
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict()}
    lines: list[str] = []
    result = run_docker(cfg, spec, on_line=lines.append, image=stage_image, flow_run_id="test-bridge")

    text = "\n".join(lines)
    assert result.step == 12, text[-3000:]
    assert complete_steps(Run("bridge", open_store(cfg.store))) == [4, 8, 12]
    # both nodes' ranks logged, with their node prefix; rank 0's metrics reached MLflow from inside
    joined = sorted(ln.split("]")[0] for ln in lines if "of 2 joined" in ln)
    assert joined == ["[node 0", "[node 1"], text[-3000:]
    assert "2 ranks on cpu" in text and "network=lmyard-bridge-" in text
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    history = client.get_metric_history(lineage.ref.mlflow_run_id, "loss/train")
    assert [m.step for m in history] == list(range(1, 13))
    # each node's system metrics, sampled inside its container
    for node in ("node0", "node1"):
        assert client.get_metric_history(lineage.ref.mlflow_run_id, f"system/{node}/system_memory_usage_megabytes"), (
            node
        )
    assert _ours(docker_client, "bridge") == ([], [])


def test_cancelling_the_follower_removes_every_container_and_the_network(docker_client, stage_image, image_sharded):
    tmp, shards, _, _ = image_sharded
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp,
            steps=5000,
            **{
                "data.source": str(tmp / "corpus.jsonl"),
                "run_name": "cancelled",
                "launch.backend": "docker",
                "launch.nnodes": 2,
                "launch.nproc_per_node": 1,
                "launch.docker.network": "bridge",
                "launch.docker.shm_size": "256m",
                **NO_MEMLOCK,
                "checkpoint.interval": 1000,
            },
        ),
    )
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    seen: list[str] = []

    def on_line(line: str) -> None:  # Ctrl-C (or Prefect's cancellation) arrives while steps are running
        seen.append(line)
        if "step 3/5000" in line:
            assert len(_ours(docker_client, "cancelled")[0]) == 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_docker(cfg, spec, on_line=on_line, image=stage_image, flow_run_id="test-cancel")
    assert _ours(docker_client, "cancelled") == ([], []), "\n".join(seen[-20:])


def test_leftovers_of_the_same_flow_run_are_removed_and_others_kept(docker_client, stage_image):
    mine = docker_client.containers.create(
        stage_image, ["true"], labels={"lmyard.run_name": "left", "lmyard.flow_run_id": "fr-left"}
    )
    other = docker_client.containers.create(
        stage_image, ["true"], labels={"lmyard.run_name": "left", "lmyard.flow_run_id": "fr-other"}
    )
    training = docker_client.containers.create(
        stage_image,
        ["true"],
        labels={"lmyard.run_name": "left", "lmyard.flow_run_id": "fr-left", "lmyard.stage": "train"},
    )
    try:
        # an evaluation of the same flow run starting while training runs leaves the trainer alone
        assert remove_leftovers(docker_client, "fr-left", log=lambda s: None, stage="evaluate") == 0
        assert remove_leftovers(docker_client, "fr-left", log=lambda s: None) == 2
        assert [c.id for c in _ours(docker_client, "left")[0]] == [other.id]
    finally:
        for c in (mine, other, training):
            try:
                c.remove(force=True)
            except Exception:
                pass


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_killed_container_fails_the_task_and_the_retry_resumes_from_the_s3_checkpoint(
    docker_client, stage_image, s3_server, s3_bucket, prefect_api_url, tmp_path
):
    from prefect import flow

    from tasks.train import train

    # Host networking: the containers reach the S3 server on the host's 127.0.0.1, credentials via AWS_*.
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp_path,
            steps=100,
            **{
                "store": f"s3://{s3_bucket}/lmyard",
                "run_name": "killed",
                "launch.backend": "docker",
                "launch.nnodes": 2,
                "launch.nproc_per_node": 1,
                "launch.docker.network": "host",
                "launch.docker.socket_ifname": "lo",
                "launch.docker.rdzv_port": free_port(),
                "launch.docker.shm_size": "256m",
                **NO_MEMLOCK,
                "launch.docker.image": stage_image,
                "checkpoint.interval": 20,
                "eval.interval": 1000,
                "train.log_interval": 20,
                "tracking.uri": f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}",
            },
        ),
    )
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    store = open_store(cfg.store)
    (tmp_path / "mlflow").mkdir()
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address=shards.address, code_version="test")
    _writable_by_image(tmp_path / "mlflow")  # rank 0 logs metrics into it from its container
    killed: list[str] = []

    def kill_node_1_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            if complete_steps(Run("killed", store)):
                for c in docker_client.containers.list(filters={"label": ["lmyard.run_name=killed", "lmyard.node=1"]}):
                    c.kill()
                    killed.append(c.name)
            time.sleep(0.2)

    @flow(name="train-only")
    def train_only():
        return train.with_options(retries=1, retry_delay_seconds=0)(cfg, shards, lineage)

    records = _Records()
    logging.getLogger("prefect").addHandler(records)
    killer = threading.Thread(target=kill_node_1_after_the_first_checkpoint, daemon=True)
    killer.start()
    try:
        result = train_only()
    finally:
        logging.getLogger("prefect").removeHandler(records)
        killer.join(timeout=5)
    text = "\n".join(records.messages)
    assert killed, text[-3000:]
    assert "exited with code 137 (killed)" in text
    resumed = [m for m in records.messages if m.startswith("[node ") and "resuming from s3://" in m]
    assert len(resumed) == 1
    start = int(resumed[0].split("at step ")[1].split()[0])
    assert 20 <= start < 100
    assert result.step == 100 and complete_steps(Run("killed", store))[-1] == 100
    assert _ours(docker_client, "killed") == ([], [])
    for secret in (s3_server.env["AWS_SECRET_ACCESS_KEY"], s3_server.env["AWS_ACCESS_KEY_ID"]):
        assert secret not in text


def test_the_watchdog_ends_a_stalled_two_container_job_and_the_retry_resumes(
    docker_client, stage_image, image_sharded, monkeypatch
):
    from lmyard.errors import TrainingFailed

    tmp, shards, _, _ = image_sharded
    faults = _writable_by_image(tmp / "faults-watchdog")  # fired faults recorded across attempts
    monkeypatch.setenv("LMYARD_FAULTS", "hang@6")
    monkeypatch.setenv("LMYARD_FAULTS_STATE", str(faults))
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp,
            steps=10,
            **{
                "data.source": str(tmp / "corpus.jsonl"),
                "run_name": "stalled",
                "launch.backend": "docker",
                "launch.nnodes": 2,
                "launch.nproc_per_node": 1,
                "launch.docker.network": "bridge",
                "launch.docker.shm_size": "256m",
                **NO_MEMLOCK,
                "launch.docker.volumes": f"['{faults}:{faults}']",
                "launch.watchdog_s": 8,
                "checkpoint.interval": 4,
                "eval.interval": 100,
            },
        ),
    )
    _writable_by_image(tmp / "store")
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(TrainingFailed, match="watchdog: no training step completed for .* rank-0 after step 6"):
        run_docker(cfg, spec, on_line=lines.append, image=stage_image, flow_run_id="test-stalled")
    assert time.monotonic() - t0 < 240, "the stall was not ended in time"
    assert any("injected hang of rank 1 after step 6" in ln for ln in lines), "\n".join(lines[-20:])
    assert _ours(docker_client, "stalled") == ([], [])
    assert complete_steps(Run("stalled", open_store(cfg.store))) == [4]

    result = run_docker(cfg, spec, on_line=lines.append, image=stage_image, flow_run_id="test-stalled")
    assert result.start_step == 4 and result.step == 10


def test_evaluate_and_export_run_in_the_image_through_the_launcher(docker_client, stage_image, image_sharded):
    """On the Docker backend every stage runs in the stage image, through the same launcher and follower as
    training: here the evaluation and the export of a checkpoint the host trained."""
    from lmyard.launch.launcher import launch

    tmp, shards, _, _ = image_sharded
    overrides = tiny_overrides(
        tmp,
        steps=2,
        **{
            "data.source": str(tmp / "corpus.jsonl"),
            "run_name": "evaluated",
            "launch.nproc_per_node": 1,
            "checkpoint.interval": 2,
        },
    )
    cfg = load_recipe("smoke", overrides)
    run_local(cfg, TrainSpec(config=cfg, shards=shards), on_line=lambda s: None)
    _writable_by_image(tmp / "store")
    in_docker = load_recipe(
        "smoke", [*overrides, "launch.backend=docker", f"launch.docker.image={stage_image}", *NO_MEMLOCK_SET]
    )
    lines: list[str] = []
    result = launch(EvalSpec(config=in_docker, shards=shards), on_line=lines.append)
    assert isinstance(result, EvalResult)
    assert result.step == 2 and result.checkpoint.endswith("step_00000002") and result.val_loss > 0
    assert any(f"image={stage_image}" in line and "lmyard.stages evaluate" in line for line in lines)
    exported = launch(
        ExportSpec(config=in_docker, source=f"{cfg.store}/runs/evaluated", dest=str(tmp / "hf")), on_line=lines.append
    )
    assert isinstance(exported, ExportResult) and exported.step == 2
    assert (tmp / "hf" / "model.safetensors").stat().st_uid == IMAGE_UID  # written in the container
    assert _ours(docker_client, "evaluated") == ([], [])


@pytest.fixture(scope="session")
def base_image(docker_client):
    """The small Debian base (debootstrap, cached): enough for the GPU engine check, which runs before training."""
    from lmyard.launch.images import build_base

    return build_base(docker_client, log=lambda s: None)


@pytest.mark.parametrize(
    ("driver_dir", "missing"),
    [
        ("tmp", "nodes 0, 1 on unix:///var/run/docker.sock: /dev/nvidiactl does not exist there"),
        ("/nonexistent/nvidia", "the driver folder /nonexistent/nvidia does not exist there"),
    ],
)
def test_devices_mode_without_device_nodes_is_refused_before_any_container_and_leaves_nothing(
    docker_client, base_image, tmp_path, driver_dir, missing
):
    # this machine has no /dev/nvidia*: the engine check's throwaway container cannot start
    from lmyard.errors import UserError

    driver_dir = str(tmp_path) if driver_dir == "tmp" else driver_dir
    cfg = load_recipe(
        "smoke",
        [
            f"store={tmp_path / 'store'}",
            "run_name=no-gpus",
            "launch.backend=docker",
            "launch.nnodes=2",
            "launch.docker.network=bridge",
            "launch.docker.gpu_mode=devices",
            "launch.docker.node_gpus=['0', '1']",
            f"launch.docker.driver_dir={driver_dir}",
        ],
    )
    spec = {
        "config": cfg.model_dump(mode="json"),
        "shards": {"address": "none", "uri": "none", "manifest": {}},
        "lineage": None,
    }
    lines: list[str] = []
    with pytest.raises(UserError) as e:
        run_docker(cfg, spec, on_line=lines.append, image=base_image, flow_run_id="test-no-gpus")
    message = str(e.value)
    assert "\n" not in message and "launch.docker.gpu_mode=devices" in message and missing in message, message
    assert e.value.exit_code == 2
    assert not any(line.startswith("node ") for line in lines)  # no training container was described
    assert _ours(docker_client, "no-gpus") == ([], [])


def test_devices_mode_keeps_the_images_library_path_after_the_drivers(docker_client, base_image, tmp_path):
    # A container's environment replaces the image's LD_LIBRARY_PATH: the launcher reads the image's and appends it
    import queue

    from lmyard.errors import UserError
    from lmyard.launch.docker_job import DockerJob
    from lmyard.stages import TrainSpec

    holder = docker_client.containers.create(base_image, ["true"])
    image = holder.commit(repository="lmyard-test-ldpath", tag="1", changes=["ENV LD_LIBRARY_PATH=/opt/cuda/lib64"])
    holder.remove(force=True)
    try:
        cfg = load_recipe(
            "smoke",
            [
                f"store={tmp_path / 'store'}",
                "run_name=ld-path",
                "launch.backend=docker",
                "launch.docker.gpu_mode=devices",
                "launch.docker.gpus=1",
                f"launch.docker.driver_dir={tmp_path}",
            ],
        )
        spec = TrainSpec(config=cfg.model_dump(mode="json"), shards={"address": "none", "uri": "none", "manifest": {}})
        job = DockerJob(cfg, spec, on_line=lambda s: None, image="lmyard-test-ldpath:1")
        assert job.plan.nodes[0].kwargs["environment"]["LD_LIBRARY_PATH"] == f"{tmp_path}/lib64"
        try:
            with pytest.raises(UserError, match="/dev/nvidiactl does not exist"):  # no GPUs here
                job.start(queue.Queue())
        finally:
            job.close()
        env = job.plan.nodes[0].kwargs["environment"]
        assert env["LD_LIBRARY_PATH"] == f"{tmp_path}/lib64:/opt/cuda/lib64"
        assert _ours(docker_client, "ld-path") == ([], [])
    finally:
        docker_client.images.remove(image.id, force=True)


def _engine_refuses_memlock(client, image) -> bool:
    """Whether this engine refuses memlock unlimited (no CAP_SYS_RESOURCE), as the default ulimits ask."""
    import docker
    from docker.types import Ulimit

    probe = client.containers.create(image, ["true"], ulimits=[Ulimit(name="memlock", soft=-1, hard=-1)])
    try:
        probe.start()
        return False
    except docker.errors.APIError:
        return True
    finally:
        probe.remove(force=True)


@pytest.mark.parametrize("ulimits", ["{bogus: 1}", "{memlock: -1, stack: 67108864}"])
def test_a_container_the_engine_refuses_is_one_line_naming_node_engine_and_key_and_not_retried(
    docker_client, base_image, cli_env, tmp_path, ulimits
):
    from conftest import lmyard_cmd

    if "memlock" in ulimits and not _engine_refuses_memlock(docker_client, base_image):
        pytest.skip("this engine may raise memlock (it has CAP_SYS_RESOURCE)")
    run_name = f"refused-{'memlock' if 'memlock' in ulimits else 'bogus'}"
    overrides = tiny_overrides(
        tmp_path,
        **{
            "run_name": run_name,
            "launch.backend": "docker",
            "launch.docker.image": base_image,  # never runs: the engine refuses the container at its start
            "launch.docker.ulimits": ulimits,
            "launch.retries": 2,
        },
    )
    engine = load_recipe("smoke", overrides).launch.docker.nodes[0]
    done = subprocess.run(
        lmyard_cmd("run", "smoke", *[x for o in overrides for x in ("--set", o)]),
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stderr
    assert done.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"lmyard: error: node 0: the Docker engine {engine} refused its container ("), out[-3000:]
    assert "rlimit" in last and "change launch.docker.ulimits" in last
    assert "memlock" not in ulimits or "(memlock): operation not permitted" in last and "CAP_SYS_RESOURCE" in last
    assert out.count("refused its container") == 1 and "Traceback" not in out and "Retry" not in out, out[-3000:]
    assert _ours(docker_client, run_name) == ([], [])
