"""The Docker backend of lmyard.launch: one container per node in the stage image.

    run_docker(cfg, spec, on_line=log, flow_run_id=id)

Training runs torchrun in each container, c10d rendezvous on node 0; every other
stage (shard, evaluate, export) runs `python -m lmyard.stages STAGE` in one
container, its spec in LMYARD_SPEC.

Design notes: docs/launch.md, `lmyard/launch/docker_job.py`.
"""

from __future__ import annotations

import copy
import io
import json
import os
import queue
import tarfile
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from lmyard.config import DockerConfig, RayConfig, RunConfig
from lmyard.errors import UserError
from lmyard.launch.follower import Follower
from lmyard.launch.gpus import check_engine, node_gpus
from lmyard.launch.job import stage_command, stage_env
from lmyard.launch.peers import docker_unreachable
from lmyard.launch.refusals import refused
from lmyard.stages import EXCHANGE_ENV, SPEC_ENV, StageSpec, TrainSpec

LABEL = "lmyard"  # label keys: lmyard.run_name, lmyard.flow_run_id, lmyard.launch_id, lmyard.stage, lmyard.node
EXCHANGE_DIR = "/tmp/lmyard-exchange"  # inside each container


@dataclass
class NodePlan:
    """One node's container: the engine URL and the keyword arguments of `containers.create`."""

    index: int
    url: str
    kwargs: dict
    secrets: set[str] = field(default_factory=set)  # environment names whose values are masked


@dataclass
class LaunchPlan:
    launch_id: str
    image: str
    network: str | None  # the bridge network to create, or None on host networking
    labels: dict[str, str]
    nodes: list[NodePlan]


def secret_names(dc: DockerConfig | RayConfig, environ: Mapping[str, str]) -> list[str]:
    """Variables passed through from the launching process: every AWS_*, MLflow's credentials
    (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN, see lmyard.tracking.credentials), plus launch.docker.pass_env
    (or launch.ray.pass_env)."""
    mlflow = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    names = [k for k in environ if k.startswith("AWS_") or k in mlflow] + [k for k in dc.pass_env if k in environ]
    return sorted(set(names))


def _node_host(url: str) -> str:
    """The address node 0 is reached at, from its engine URL (a local socket: this machine)."""
    parsed = urlparse(url)
    if parsed.scheme in ("tcp", "ssh", "http", "https") and parsed.hostname:
        return parsed.hostname
    return "127.0.0.1"


def _local_addr(urls: list[str], i: int) -> str:
    """The address node i is known by in the rendezvous, on host networking.

    The rendezvous tells nodes apart by (address, pid); containers sharing a host's network all run
    torchrun as pid 1 and share its hostname. Nodes on one local engine get loopback aliases
    127.0.0.{i+1} (all of 127/8 is loopback); a remote node is its engine's host name.
    """
    parsed = urlparse(urls[i])
    if parsed.scheme in ("tcp", "ssh", "http", "https") and parsed.hostname:
        return parsed.hostname
    return f"127.0.0.{i + 1}"


def _local_store_root(store: str) -> str | None:
    if "://" in store and not store.startswith("file://"):
        return None
    from lmyard.store import LocalStore

    return LocalStore(store).root


def _sqlite_dir(uri: str) -> tuple[str, str] | None:
    """(absolute URI, folder to mount) for a sqlite:/// tracking URI; None for a server."""
    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///")).expanduser().resolve()
    return f"sqlite:///{path}", str(path.parent)


def _mounted(cfg: RunConfig, spec: dict) -> tuple[dict, dict[str, dict]]:
    """The spec as the containers see it (absolute paths for what is bind-mounted at the same path: a local
    store, a sqlite tracking folder, an export's local destination folder's parent) and the bind mounts,
    launch.docker.volumes included."""
    spec = copy.deepcopy(spec)
    mounts: dict[str, dict] = {}
    if spec.get("dest") and "://" not in spec["dest"]:  # an export to a folder here: its parent, writable
        spec["dest"] = dest = os.path.abspath(spec["dest"])
        mounts[os.path.dirname(dest)] = {"bind": os.path.dirname(dest), "mode": "rw"}
    store_root = _local_store_root(cfg.store)
    if store_root is not None:
        spec["config"]["store"] = store_root
        mounts[store_root] = {"bind": store_root, "mode": "rw"}
    lineage = spec.get("lineage")
    if lineage and (sqlite := _sqlite_dir(lineage["tracking_uri"])):
        lineage["tracking_uri"], folder = sqlite
        mounts[folder] = {"bind": folder, "mode": "rw"}
    for v in cfg.launch.docker.volumes:
        host, _, rest = v.partition(":")
        bind, _, mode = rest.partition(":")
        if not host or not bind:
            raise UserError(f"launch.docker.volumes: {v!r} is not host:container[:ro]")
        mounts[host] = {"bind": bind, "mode": mode or "rw"}
    return spec, mounts


def _labels(run_name: str, flow_run_id: str | None, launch_id: str, stage: str) -> dict[str, str]:
    """What finds a launch's containers again (cleanup of a retry, of one stage only; the drills)."""
    return {
        f"{LABEL}.run_name": run_name,
        f"{LABEL}.flow_run_id": flow_run_id or "",
        f"{LABEL}.launch_id": launch_id,
        f"{LABEL}.stage": stage,
    }


def plan(
    cfg: RunConfig,
    spec: StageSpec | dict,
    *,
    image: str,
    flow_run_id: str | None = None,
    environ: Mapping[str, str] | None = None,
    launch_id: str | None = None,
) -> LaunchPlan:
    """The containers of one launch (a dict spec is a TrainSpec): commands, environment, mounts, devices,
    network, labels."""
    environ = os.environ if environ is None else environ
    launch, dc = cfg.launch, cfg.launch.docker
    launch_id = launch_id or uuid.uuid4().hex[:12]
    stage = spec if isinstance(spec, StageSpec) else TrainSpec.model_validate(spec)
    nnodes = stage.nodes()
    urls = dc.nodes if len(dc.nodes) == nnodes else dc.nodes * nnodes
    base_name = f"lmyard-{cfg.run_name}-{launch_id}"[:50]
    names = [f"{base_name}-node{i}" for i in range(nnodes)]
    network = f"{base_name}-net" if dc.network == "bridge" and nnodes > 1 else None
    labels = _labels(cfg.run_name, flow_run_id, launch_id, stage.stage)
    spec, mounts = _mounted(cfg, stage.model_dump(mode="json"))
    commands = _commands(cfg, stage, urls, names, network, launch_id)
    env, secrets = _environment(cfg, spec, environ)
    gpus = node_gpus(launch, urls[:nnodes])  # devices, mounts, namespaces per node (lmyard.launch.gpus)
    nodes = []
    for i in range(nnodes):
        kwargs = dict(
            image=image,
            command=commands[i],
            name=names[i],
            hostname=names[i] if network else None,
            labels={**labels, f"{LABEL}.node": str(i)},
            environment={**gpus[i].env, **env},
            volumes=dict(mounts),
            shm_size=None if gpus[i].kwargs.get("ipc_mode") == "host" else dc.shm_size,
            ulimits=_ulimits(dc.ulimits),
            **gpus[i].kwargs,
            network_mode=None if network else "host",
            network=network,
            user=dc.user,
            detach=True,
        )
        nodes.append(NodePlan(i, urls[i], {k: v for k, v in kwargs.items() if v is not None}, set(secrets)))
    return LaunchPlan(launch_id, image, network, labels, nodes)


def _commands(
    cfg: RunConfig, stage: StageSpec, urls: list[str], names: list[str], network: str | None, launch_id: str
) -> list[list[str]]:
    """Each node's torchrun command: c10d rendezvous hosted by node 0's agent, a fresh rendezvous id per launch (a
    straggler from an earlier attempt cannot join this one)."""
    dc, nnodes = cfg.launch.docker, len(names)
    addrs = dc.node_addrs or [_local_addr(urls, i) for i in range(nnodes)]
    node0 = dc.node_addrs[0] if dc.node_addrs else _node_host(urls[0])
    rdzv = f"{names[0]}:{dc.rdzv_port}" if network else cfg.launch.rdzv_endpoint or f"{node0}:{dc.rdzv_port}"
    local = None if network or (nnodes == 1 and not dc.node_addrs) else addrs
    return [
        stage_command(cfg, stage, python="python", rdzv_endpoint=rdzv, rdzv_id=launch_id, node=i, local_addr=addr)
        for i, addr in enumerate(local or [None] * nnodes)
    ]


def _environment(cfg: RunConfig, spec: dict, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Every container's environment (the spec in LMYARD_SPEC) and the names of the secrets passed through."""
    dc = cfg.launch.docker
    env = {
        **stage_env(cfg),
        EXCHANGE_ENV: EXCHANGE_DIR,
        SPEC_ENV: json.dumps(spec, separators=(",", ":")),
        **dc.env,
    }
    if dc.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = dc.socket_ifname
    for name in ("LMYARD_FAULTS", "LMYARD_FAULTS_STATE", "LMYARD_FAULT_PAUSE_S"):  # failure drills
        if environ.get(name):
            env[name] = environ[name]
    secrets = secret_names(dc, environ)
    env.update({k: environ[k] for k in secrets})
    return env, secrets


def _ulimits(limits: dict[str, int]):
    from docker.types import Ulimit

    return [Ulimit(name=name, soft=value, hard=value) for name, value in limits.items()] or None


def describe(node: NodePlan) -> str:
    """One line for the log: where the node runs and what; secrets masked, the spec abbreviated."""
    k = node.kwargs
    env = {
        name: ("***" if name in node.secrets else "<spec>" if name == SPEC_ENV else v)
        for name, v in k["environment"].items()
    }
    gpus = [dict(r) for r in k.get("device_requests", [])]
    return (
        f"node {node.index} on {node.url}: {k['name']} image={k['image']} "
        f"network={k.get('network') or k.get('network_mode')} shm={k.get('shm_size', 'host')} "
        f"gpus={gpus or k.get('devices') or 'none'} "
        f"mounts={sorted(k['volumes'])} env={env} cmd={' '.join(k['command'])}"
    )


class _Masker:
    """Replaces the values of passed-through secrets in text."""

    def __init__(self, values: list[str]):
        self.values = sorted((v for v in values if len(v) >= 4), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for v in self.values:
            text = text.replace(v, "***")
        return text


# ---------------------------------------------------------------- engines


def connect(url: str, dc: DockerConfig):
    """A docker SDK client for one node's engine: unix socket, tcp (TLS from tls_cert_dir), or ssh."""
    import docker

    scheme = urlparse(url).scheme
    try:
        if scheme == "ssh":  # the system ssh client: keys and known_hosts as the operator set them up
            client = docker.DockerClient(base_url=url, use_ssh_client=True, timeout=60)
        elif scheme in ("tcp", "https"):
            cert_dir = dc.tls_cert_dir or os.environ.get("DOCKER_CERT_PATH")
            if not cert_dir:
                raise UserError(
                    f"engine {url}: a tcp:// engine needs TLS; set launch.docker.tls_cert_dir "
                    "(ca.pem, cert.pem, key.pem) or DOCKER_CERT_PATH"
                )
            tls = docker.tls.TLSConfig(
                client_cert=(f"{cert_dir}/cert.pem", f"{cert_dir}/key.pem"), ca_cert=f"{cert_dir}/ca.pem", verify=True
            )
            client = docker.DockerClient(base_url=url, tls=tls, timeout=60)
        else:
            client = docker.DockerClient(base_url=url, timeout=60)
        client.ping()
        return client
    except docker.errors.DockerException as e:
        raise UserError(f"cannot reach the Docker engine {url}: {e}") from None


def remove_leftovers(client, flow_run_id: str, log: Callable[[str], None], stage: str | None = None) -> int:
    """Remove containers and networks an earlier attempt of this flow run left behind (of one stage only when
    given: training goes on while the same flow run evaluates a checkpoint)."""
    import docker

    selector = {"label": [f"{LABEL}.flow_run_id={flow_run_id}", *([f"{LABEL}.stage={stage}"] if stage else [])]}
    n = 0
    for c in client.containers.list(all=True, filters=selector):
        log(f"removing leftover container {c.name} of this flow run")
        try:
            c.remove(force=True, v=True)
            n += 1
        except docker.errors.NotFound:
            pass
    for net in client.networks.list(filters=selector):
        try:
            net.remove()
        except docker.errors.NotFound:
            pass
    return n


# ---------------------------------------------------------------- the job


class DockerJob:
    """One container per node, followed through the engines (see lmyard.launch.job.Job)."""

    def __init__(
        self,
        cfg: RunConfig,
        spec: StageSpec,
        on_line: Callable[[str], None],
        *,
        image: str | None = None,
        flow_run_id: str | None = None,
    ):
        if image is None:
            from lmyard.launch.images import image_tag

            registry = cfg.launch.docker.registry
            image = cfg.launch.docker.image or (f"{registry}/{image_tag()}" if registry else image_tag())
        self.cfg, self.spec, self.on_line, self.image, self.flow_run_id = cfg, spec, on_line, image, flow_run_id
        self.plan = plan(cfg, spec, image=image, flow_run_id=flow_run_id)
        self.nodes = len(self.plan.nodes)
        self.mask = _Masker([v for n in self.plan.nodes for k, v in n.kwargs["environment"].items() if k in n.secrets])
        self.clients: dict = {}
        self.containers: list = []
        self.network = None
        self.stopping = threading.Event()

    def start(self, events: queue.Queue) -> None:
        from lmyard.launch.images import ensure_images

        dc = self.cfg.launch.docker
        self.clients = {url: connect(url, dc) for url in dict.fromkeys(n.url for n in self.plan.nodes)}
        # every engine gets the image (pinned to the registry's digest, pulled where missing) before any container
        on = {url: [n.index for n in self.plan.nodes if n.url == url] for url in self.clients}
        self.image, images = ensure_images(self.clients, self.image, on, self.on_line)
        self.plan.image = self.image
        for url, client in self.clients.items():
            if self.flow_run_id:
                remove_leftovers(client, self.flow_run_id, self.on_line, self.spec.stage)
            here = [n for n in self.plan.nodes if n.url == url]
            for n in here:
                n.kwargs["image"] = self.image
            check_engine(
                client, url, here, images[url], mode=dc.gpu_mode, driver_dir=dc.driver_dir, labels=self.plan.labels
            )
        first = self.plan.nodes[0].url
        if self.plan.network:
            with refused(f"network {self.plan.network}", first):
                self.network = self.clients[first].networks.create(
                    self.plan.network, driver="bridge", labels=self.plan.labels
                )
        for node in self.plan.nodes:
            self.on_line(self.mask(describe(node)))
            with refused(f"node {node.index}", node.url):
                self.containers.append(self.clients[node.url].containers.create(**node.kwargs))
        for node, c in zip(self.plan.nodes, self.containers):
            with refused(f"node {node.index}", node.url):
                c.start()
            threading.Thread(
                target=self._pump, args=(node.index, c, events), daemon=True, name=f"docker-logs-{node.index}"
            ).start()

    def _pump(self, i: int, c, events: queue.Queue) -> None:
        try:
            buf = b""
            for chunk in c.logs(stream=True, follow=True, stdout=True, stderr=True):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    events.put(("line", i, self.mask(line.decode(errors="replace"))))
            if buf:
                events.put(("line", i, self.mask(buf.decode(errors="replace"))))
            events.put(("exit", i, c.wait()["StatusCode"]))
        except Exception as e:  # the engine stopped answering (stopped, unreachable)
            if not self.stopping.is_set():
                events.put(
                    ("error", i, f"its engine {self.plan.nodes[i].url} stopped answering: {' '.join(str(e).split())}")
                )

    def _files(self, i: int, path: str) -> dict[str, bytes]:
        """Regular files at `path` (a file or a folder) in container i, by base name; {} when absent, or when its
        engine stopped answering (its log stream says the node is lost: `_pump`)."""
        import docker

        try:
            stream, _ = self.containers[i].get_archive(path)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                return {
                    os.path.basename(m.name): tar.extractfile(m).read()  # type: ignore[union-attr]  # isfile(): has one
                    for m in tar.getmembers()
                    if m.isfile() and not os.path.basename(m.name).startswith(".")
                }
        except (docker.errors.APIError, tarfile.TarError, OSError):  # requests' errors are OSErrors
            return {}

    def read(self, name: str) -> bytes | None:
        return self._files(0, f"{EXCHANGE_DIR}/{name}").get(os.path.basename(name)) if self.containers else None

    def read_all(self, folder: str) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for i in range(len(self.containers)):
            out.update(self._files(i, f"{EXCHANGE_DIR}/{folder}"))
        return out

    def _each(self, action: Callable) -> None:
        """`action(container)` on every container at once (docker stop blocks until the container ends)."""
        import docker

        def run(c) -> None:
            try:
                action(c)
            except (docker.errors.APIError, OSError):  # gone, or its engine is (requests' errors are OSErrors)
                pass

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in self.containers]
        for t in threads:
            t.start()

    def terminate(self) -> None:
        # SIGTERM to torchrun (pid 1), which forwards it to its ranks; the engine kills after the grace
        self._each(lambda c: c.stop(timeout=int(self.cfg.launch.grace_s) + 15))

    def kill(self) -> None:
        self._each(lambda c: c.kill())

    def stalled_peers(self) -> tuple[str, list[int]] | None:  # the watchdog's line: a node that cannot reach node 0
        return docker_unreachable(self.plan.nodes, self.containers, self.clients)

    def why(self, node: int, code: int) -> str:
        try:
            container = self.containers[node]
            container.reload()
            if container.attrs["State"].get("OOMKilled"):
                return " (out of memory)"
        except Exception:
            pass
        return " (killed)" if code == 137 else ""

    def close(self) -> None:
        """Kill and remove every container, then the network; each step tolerates what is already gone, an engine
        that stopped answering included (the containers on the other engines are removed all the same)."""
        import docker

        self.stopping.set()
        for c in self.containers:
            try:
                c.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass
            except Exception as e:  # the engine is gone (stopped, unreachable): nothing to remove through it
                self.on_line(f"container {c.name} not removed, its engine does not answer: {' '.join(str(e).split())}")
        if self.network is not None:
            try:
                self.network.remove()
            except docker.errors.NotFound:
                pass
        for client in self.clients.values():
            client.close()


def run_docker(
    cfg: RunConfig,
    spec: StageSpec | dict,
    on_line: Callable[[str], None] = print,
    *,
    image: str | None = None,
    flow_run_id: str | None = None,
    **callbacks,
):
    """Run a stage in the stage image (training: one container per node) and follow it (a dict is a TrainSpec);
    its result, or the error its exit code names (lmyard.launch.follower.Follower)."""
    spec = spec if isinstance(spec, StageSpec) else TrainSpec.model_validate(spec)
    job = DockerJob(cfg, spec, on_line, image=image, flow_run_id=flow_run_id)
    return Follower(job, cfg, on_line, **callbacks).run()
