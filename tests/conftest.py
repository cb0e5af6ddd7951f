"""Shared fixtures: tiny configs, a Prefect test server and an S3 server shared by the session."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# One CPU thread per torch process, trainer ranks included (the LMYARD_* layer under every recipe and --set; the
# launcher passes the resolved config to containers, Ray actors and other hosts): the suite runs 3 workers on 2
# cores, each starting several processes, and tiny models' ops gain nothing from more threads. torch's default
# (cores / local ranks) oversubscribes the cores and spins: measured, a two-container test took twice as long.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LMYARD_TRAIN__THREADS_PER_RANK", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # inductor compiles in the rank, no pool of workers
# The MLflow servers tests start track runs only: no job runner beside each (MLflow 3's huey consumer and its
# periodic tasks, a process polling the store for the whole session).
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Once, in the controller: the project's bytecode, which the environment may forbid processes to write
    (PYTHONDONTWRITEBYTECODE, set on CI): the suite's hundreds of ranks, CLIs and flows each compiled lmyard's
    modules again at their start (0.3 s of CPU a trainer rank). py_compile writes it whatever that setting says."""
    if not hasattr(config, "workerinput"):
        import compileall

        for part in ("lmyard", "flows", "tasks"):
            compileall.compile_dir(str(REPO / part), quiet=1)


# The folder is the tier (docs/tests.md): tests/unit/<part>/ mirrors lmyard's parts, tests/integration/ holds the
# tests that start servers, train or compile; each of its tests is marked `integration`, so `-m integration` and
# `-m "not integration"` still pick a tier. A test belongs in tests/integration/ when it is `slow`, uses one of
# these servers (directly or through another fixture), or is marked `integration` by hand (it trains, compiles or
# runs Triton's interpreter for seconds; a server through request.getfixturevalue): under tests/unit/ it is a
# collection error.
SERVER_FIXTURES = {"prefect_api_url", "cli_env", "s3_server", "s3_bucket", "mlflow_server"}
UNIT, INTEGRATION = REPO / "tests" / "unit", REPO / "tests" / "integration"


# Under pytest-xdist (`-n N`, .ci/run) a test file's tests run on one worker, in order, so its module fixtures (an
# image, simulated hosts, a registry) are made once; the files that use one shared thing of this machine also share
# a worker: Ray's test cluster on 127.0.0.1. The files that take longest go first (measured on 2 cores), so no
# worker starts one of them last (pyproject's addopts keep this order: --no-loadscope-reorder).
SHARED_WORKER = {"test_ray.py": "ray", "test_sweeps_integration.py": "ray"}
LONGEST_FIRST = (
    "test_hosts.py",
    "test_hosts_ray.py",
    "test_docker.py",
    "test_ray.py",
    "test_sweeps_integration.py",
    "test_hosts_prefect.py",
    "test_deployments.py",
    "test_slurm.py",
    "test_interrupts.py",
    "test_preemption.py",
    "test_compile_cache_integration.py",
)


def integration_by_rule(item: pytest.Item) -> bool:
    """Whether a test belongs in tests/integration/: `slow`, using a server fixture, or marked `integration`."""
    marked = item.get_closest_marker("slow") or item.get_closest_marker("integration")
    return bool(marked or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test file under tests/unit/ holding a test of the integration tier fails to collect, saying where it goes."""
    report = yield
    if report.passed and UNIT in Path(collector.path).parents:
        wrong = [i for i in report.result if isinstance(i, pytest.Item) and integration_by_rule(i)]
        if wrong:
            report.outcome = "failed"
            report.result = []
            report.longrepr = "\n".join(
                f"{i.nodeid} is an integration test (slow, using a server, or marked integration): move it to "
                "tests/integration/"
                for i in wrong
            )
    return report


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
    for item in items:
        if INTEGRATION in item.path.parents or integration_by_rule(item):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, a scope being a test file or the group of SHARED_WORKER it is in."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return SHARED_WORKER.get(name, name)

    return ByFile(config, log)


def gpt2_ranks_or_skip():
    """GPT-2's BPE (tiktoken r50k_base), or the test skips saying how to provide it: offline, tiktoken reads its
    ranks from TIKTOKEN_CACHE_DIR (.ci/run points it at ../shared/tiktoken when that folder exists)."""
    tiktoken = pytest.importorskip("tiktoken")
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception:
        pytest.skip(
            "GPT-2's BPE ranks (tiktoken r50k_base) do not load here: set TIKTOKEN_CACHE_DIR to a tiktoken cache"
        )


_SESSION: dict[str, Path] = {}  # this worker's folder for what the session makes once (`_session_folder`)


@pytest.fixture(scope="session", autouse=True)
def _session_folder(tmp_path_factory):
    _SESSION["root"] = tmp_path_factory.getbasetemp()


def empty_mlflow_db(path: Path) -> None:
    """An empty MLflow tracking store at `path` (unless one is there), copied from one this worker made once: MLflow
    makes a new SQLite store by running each of its schema migrations, seconds of CPU that every run paid."""
    if path.exists() or "root" not in _SESSION:
        return
    template = _SESSION["root"] / "mlflow-empty.db"
    if not template.exists():
        from mlflow.tracking import MlflowClient

        making = template.with_name(f"{template.name}.{os.getpid()}")
        MlflowClient(f"sqlite:///{making}").search_experiments()
        os.replace(making, template)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, path)


def nothing_tracked_in(path: Path) -> bool:
    """No MLflow store at `path`, or still the empty one that `empty_mlflow_db` put there, byte for byte."""
    template = _SESSION["root"] / "mlflow-empty.db" if "root" in _SESSION else None
    return not path.exists() or (template is not None and filecmp.cmp(path, template, shallow=False))


def tiny_overrides(tmp: Path, steps: int = 6, **extra) -> list[str]:
    """`--set` assignments for a fast run: a 2-layer model, small batches, everything under tmp (its MLflow store
    an empty one, made at once: `empty_mlflow_db`)."""
    values = {
        "store": str(tmp / "store"),
        "tracking.uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "train.max_steps": steps,
        "train.warmup_steps": 2,
        "train.batch_tokens": 1024,
        "train.micro_batch": 4,
        "train.log_interval": 1,
        "model.n_layer": 2,
        "model.n_embd": 64,
        "model.n_head": 2,
        "model.block_size": 64,
        "eval.interval": 3,
        "eval.val_tokens": 2048,
        "eval.sample_tokens": 16,
        "checkpoint.interval": 3,
    }
    values.update(extra)
    if values["tracking.uri"] == f"sqlite:///{tmp / 'mlflow.db'}":
        empty_mlflow_db(tmp / "mlflow.db")
    return [f"{k}={v}" for k, v in values.items()]


def write_random_checkpoint(
    root: Path,
    tokenizer: str = "bytes",
    step: int = 5,
    run: str = "r",
    arch: str = "gpt2",
    seed: int = 0,
    bias: bool = True,
    spec_arch: str | None = None,
):
    """A random 2-layer GPT-2 or Llama (GPT-2's biases and LayerNorms random too, so every tensor's mapping is
    tested) saved with checkpoint_helpers.save_full under the store `root`; its checkpoint URI and the model.
    `spec_arch` overrides the architecture the checkpoint records."""
    import torch

    from lmyard.config import ModelConfig
    from lmyard.models.registry import build_model

    n_vocab = 257 if tokenizer == "bytes" else 50257
    shape = (
        {"preset": "llama-tiny"}
        if arch == "llama"
        else {"preset": None, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, "bias": bias}
    )
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**shape), n_vocab).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith(("ln_1.weight", "norm.weight")) else 0.0))
    return save_model_checkpoint(root, model, tokenizer, step, run, spec_arch), model


def save_model_checkpoint(
    root: Path, model, tokenizer: str = "bytes", step: int = 5, run: str = "r", spec_arch: str | None = None
) -> str:
    """`model` (lmyard's GPT or Llama) as the checkpoint of `step` of run `run` in the store `root`; its URI."""
    from checkpoint_helpers import save_full

    from lmyard.models.registry import model_spec
    from lmyard.recipes import load_recipe
    from lmyard.run import Run
    from lmyard.store import open_store

    spec = model_spec(model)
    if spec_arch:
        spec["arch"] = spec_arch
    state = {
        "step": step,
        "cursor": 0,
        "tokens_seen": 4096 * step,
        "world_size": 1,
        "shard_address": "0" * 64,
        "config": load_recipe("smoke", [f"tokenizer.name={tokenizer}"]).model_dump(mode="json"),
        "model": spec,
    }
    return save_full(Run(run, open_store(str(root))), step, model.state_dict(), {}, [], state, str(root / "staging"))


@pytest.fixture(scope="session")
def prefect_api_url():
    """A real Prefect server for the session (prefect_test_harness); its API URL for subprocesses too."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture
def cli_env(prefect_api_url, tmp_path):
    """Environment for `lmyard` subprocesses: the session's Prefect server, a private cache."""
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "LMYARD_CACHE": str(tmp_path / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PREFECT_HOME", None)
    return env


def lmyard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


# ---------------------------------------------------------------- Ray: a real cluster of two nodes on 127.0.0.1


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes of 1 CPU each on 127.0.0.1 (Ray swaps a loopback address for the host's own unless told
    otherwise); this process is a driver of it too, to look at its actors and placement groups."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # get_node_ip_address() -> 127.0.0.1, here (the constant is read at import) and in every Ray process
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, namespace="lmyard-tests", log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def ray_actors(run_name: str) -> list[dict]:
    """Every actor of this run's launches, dead ones included (the GCS actor table; the state API needs
    Ray's dashboard, which plain `ray` lacks)."""
    import ray

    return [a for a in ray._private.state.actors().values() if a["Name"].startswith(f"lmyard-{run_name}-")]


def ray_leftovers(run_name: str) -> tuple[list[str], list[str]]:
    """Live actors and placement groups of this run."""
    from ray.util.placement_group import placement_group_table

    alive = [a["Name"] for a in ray_actors(run_name) if a["State"] != "DEAD"]
    groups = [
        g["name"]
        for g in placement_group_table().values()
        if g["name"].startswith(f"lmyard-{run_name}-") and g["state"] != "REMOVED"
    ]
    return alive, groups


# ---------------------------------------------------------------- S3: a real S3-compatible HTTP server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """End a server started with start_new_session=True: SIGTERM to its group, then SIGKILL to what is left
    (servers such as `mlflow server` leave worker processes behind their parent)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def stop_prefect_worker(proc: subprocess.Popen, drain_s: float = 3) -> None:
    """End a `prefect worker start` started in its own group. Prefect's worker drains on the first SIGTERM (stops
    taking flow runs, waits for its own; idle, it exits at once) and kills itself on the second, which follows
    after `drain_s` when a drain has not ended."""
    for _ in range(2):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=drain_s)
            break
        except subprocess.TimeoutExpired:
            pass
    stop_group(proc, 5)


def wait_for_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None) -> None:
    """Poll `url` until it answers; fail with the server's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:] if log_path else ""
                raise RuntimeError(f"{url} did not answer:\n{tail}") from None
            time.sleep(0.2)


class S3Server:
    """moto's server mode on 127.0.0.1, enforcing IAM: requests need keys of a user whose policy allows them."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.env: dict[str, str] = {}  # AWS_* for this server's admin user; also set in os.environ
        self._n = 0

    @classmethod
    def with_admin(cls, endpoint: str) -> S3Server:
        """The server at `endpoint`, started with INITIAL_NO_AUTH_ACTION_COUNT=3: its first requests make the
        admin user whose keys go into `env`."""
        import boto3

        server = cls(endpoint)
        bootstrap = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        server.env = server.user_env("admin", [{"Effect": "Allow", "Action": "*", "Resource": "*"}], iam=bootstrap)
        return server

    def client(self, service: str = "s3", env: dict[str, str] | None = None):
        import boto3

        keys = env or self.env
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        )

    def user_env(self, name: str, statements: list[dict], iam=None) -> dict[str, str]:
        """AWS_* variables for a new IAM user allowed only what `statements` say."""
        iam = iam or self.client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(
            UserName=name,
            PolicyName=f"{name}-policy",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}),
        )
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def new_bucket(self, stem: str = "lmyard-test") -> str:
        self._n += 1
        name = f"{stem}-{self._n}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    def remove_bucket(self, name: str) -> None:
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=name, Key=obj["Key"])
        s3.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server for the session, in its own process group, ended (the whole group) at the end.

    Its first 3 requests run unauthenticated: they create an admin IAM user whose
    (test-only) keys go into AWS_* for the session. Every later request is
    authenticated and authorized, so tests can make users that get AccessDenied.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    # `python -m moto.server` is `moto_server`, found through this interpreter whether or not a venv is on PATH
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_http(f"{endpoint}/moto-api/", proc, 30)
        server = S3Server.with_admin(endpoint)
        with pytest.MonkeyPatch.context() as mp:
            for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
                mp.delenv(k, raising=False)
            for k, v in server.env.items():
                mp.setenv(k, v)
            yield server
    finally:
        stop_group(proc, 10)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the session's S3 server; removed after the test, on failure too."""
    name = s3_server.new_bucket()
    yield name
    s3_server.remove_bucket(name)


# ---------------------------------------------------------------- Prefect: a real server of its own


@contextlib.contextmanager
def prefect_server(tmp: Path):
    """`prefect server start` (sqlite under tmp) in its own process group; yields the environment of its clients
    (PREFECT_API_URL, a private PREFECT_HOME, PYTHONPATH with this checkout). Ends the whole group at the end."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "LMYARD_CACHE": str(tmp / "cache"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_http(f"http://127.0.0.1:{port}/api/health", proc, 120, tmp / "server.log")
            yield env
        finally:
            stop_group(proc, 20)


# ---------------------------------------------------------------- MLflow: a real tracking server


class MLflowServer:
    def __init__(self, uri: str, artifacts: str):
        self.uri, self.artifacts = uri, artifacts


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory):
    """`mlflow server` for the session: sqlite backend, artifacts proxied to a bucket of the S3 test server.

    It runs in its own process group, and the whole group is ended at the end: the
    server leaves worker processes (uvicorn/huey) behind when only its parent stops.
    """
    tmp = tmp_path_factory.mktemp("mlflow-server")
    bucket = s3_server.new_bucket("mlflow")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, **s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3_server.endpoint}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp / 'mlflow.db'}",
            "--artifacts-destination",
            f"s3://{bucket}/mlartifacts",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_http(f"{uri}/health", proc, 300, tmp / "server.log")  # its imports take minutes on a busy machine
        with pytest.MonkeyPatch.context() as mp:
            # The server offers clients presigned S3 URLs for downloads; against the moto server
            # (IAM enforced) those GETs fail and the client retries with long backoffs. Download
            # through the server instead (what a client outside the bucket's network does too).
            mp.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "false")
            yield MLflowServer(uri, f"s3://{bucket}/mlartifacts")
    finally:
        stop_group(proc, 15)
        log.close()


# ---------------------------------------------------------------- one finished run, shared


@pytest.fixture(scope="session")
def finished_run(s3_server, mlflow_server, prefect_api_url, tmp_path_factory):
    """One tiny run to its end (registered as models:/smoke/1, no gates): store on S3, tracking on the MLflow
    server; (environment of `lmyard` subprocesses, store URI, tracking URI). Tests read it and add to it, never
    change what it holds."""
    tmp = tmp_path_factory.mktemp("ops")
    store = f"s3://{s3_server.new_bucket('ops')}/lmyard"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "LMYARD_CACHE": str(tmp / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
    overrides = tiny_overrides(
        tmp, **{"store": store, "tracking.uri": mlflow_server.uri, "tracking.system_metrics": False}
    )
    args = lmyard_cmd("run", "smoke", *[a for o in overrides for a in ("--set", o)])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return env, store, mlflow_server.uri


@pytest.fixture
def silent_server():
    """A server on 127.0.0.1 that accepts connections and never answers (a hung tracking server): its URI."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    sock.close()
