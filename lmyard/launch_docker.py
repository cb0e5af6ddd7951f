"""The Docker launcher: one container per node, torchrun in each, c10d rendezvous on node 0.

    run_docker(cfg, spec, on_line=log, flow_run_id=id)

`plan()` turns the config into one container definition per node (pure: unit
tested without an engine); `run_docker()` connects to each node's engine,
removes leftovers of the same flow run, creates a bridge network when asked,
starts the containers and follows them: every log line goes to `on_line` as
`[node i] ...`. The first container to exit non-zero stops the run: all
containers are removed and TrainingFailed is raised, so a task retry resumes
from the newest checkpoint. Whatever ends the follow (success, failure,
KeyboardInterrupt, Prefect's TerminationSignal, an exception in `on_line`), the
containers and the network are removed in a `finally`.

Credentials (every AWS_* variable of the launching process, and the names in
launch.docker.pass_env) reach the containers through their environment only;
`describe()` and the log lines mask their values.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import queue
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from lmyard.config import DockerConfig, RunConfig
from lmyard.errors import UserError
from lmyard.launch import TrainingFailed

LABEL = "lmyard"  # label keys: lmyard.run_name, lmyard.flow_run_id, lmyard.launch_id, lmyard.node
RDZV_TIMEOUT_S = 600  # how long node 0 waits for the others to join


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


def secret_names(dc: DockerConfig, environ: Mapping[str, str]) -> list[str]:
    """Variables passed through from the launching process: every AWS_*, plus launch.docker.pass_env."""
    names = [k for k in environ if k.startswith("AWS_")] + [k for k in dc.pass_env if k in environ]
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


def plan(cfg: RunConfig, spec: dict, *, image: str, flow_run_id: str | None = None,
         environ: Mapping[str, str] | None = None, launch_id: str | None = None) -> LaunchPlan:
    """The containers of one launch: commands, environment, mounts, devices, network, labels."""
    environ = os.environ if environ is None else environ
    launch, dc = cfg.launch, cfg.launch.docker
    launch_id = launch_id or uuid.uuid4().hex[:12]
    nnodes = launch.nnodes
    urls = dc.nodes if len(dc.nodes) == nnodes else dc.nodes * nnodes
    base_name = f"lmyard-{cfg.run_name}-{launch_id}"[:50]
    names = [f"{base_name}-node{i}" for i in range(nnodes)]
    network = f"{base_name}-net" if dc.network == "bridge" and nnodes > 1 else None
    labels = {f"{LABEL}.run_name": cfg.run_name, f"{LABEL}.flow_run_id": flow_run_id or "",
              f"{LABEL}.launch_id": launch_id}

    # The spec as the containers see it: absolute paths for what is bind-mounted at the same path.
    spec = copy.deepcopy(spec)
    mounts: dict[str, dict] = {}
    store_root = _local_store_root(cfg.store)
    if store_root is not None:
        spec["config"]["store"] = store_root
        mounts[store_root] = {"bind": store_root, "mode": "rw"}
    lineage = spec.get("lineage")
    if lineage and (sqlite := _sqlite_dir(lineage["tracking_uri"])):
        lineage["tracking_uri"], folder = sqlite
        mounts[folder] = {"bind": folder, "mode": "rw"}
    for v in dc.volumes:
        host, _, rest = v.partition(":")
        bind, _, mode = rest.partition(":")
        if not host or not bind:
            raise UserError(f"launch.docker.volumes: {v!r} is not host:container[:ro]")
        mounts[host] = {"bind": bind, "mode": mode or "rw"}

    # torchrun: c10d rendezvous hosted by node 0's agent; a fresh rendezvous id per launch, so a
    # straggler from an earlier attempt cannot join this one.
    if network:
        rdzv = f"{names[0]}:{dc.rdzv_port}"
    else:
        rdzv = launch.rdzv_endpoint or f"{_node_host(urls[0])}:{dc.rdzv_port}"

    env = {"PYTHONUNBUFFERED": "1", "LMYARD_SPEC": json.dumps(spec, separators=(",", ":")), **dc.env}
    if dc.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = dc.socket_ifname
    if environ.get("LMYARD_FAULTS"):  # failure drills
        env["LMYARD_FAULTS"] = environ["LMYARD_FAULTS"]
    secrets = secret_names(dc, environ)
    env.update({k: environ[k] for k in secrets})

    device_requests = []
    if dc.gpu_ids is not None:
        device_requests = [_device_request(device_ids=list(dc.gpu_ids))]
    elif dc.gpus != 0:
        device_requests = [_device_request(count=-1 if dc.gpus == "all" else dc.gpus)]

    nodes = []
    for i in range(nnodes):
        if nnodes == 1:
            torchrun = ["--standalone", "--nnodes", "1"]
        else:
            torchrun = ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv,
                        "--rdzv_id", launch_id, "--rdzv_conf", f"is_host={int(i == 0)},join_timeout={RDZV_TIMEOUT_S}"]
            if not network:
                torchrun += ["--local_addr", _local_addr(urls, i)]
        command = ["python", "-m", "torch.distributed.run", *torchrun, "--nproc_per_node",
                   str(launch.nproc_per_node), "--max_restarts", "0", "-m", "lmyard.train"]
        kwargs = dict(
            image=image, command=command, name=names[i], hostname=names[i] if network else None,
            labels={**labels, f"{LABEL}.node": str(i)}, environment=dict(env), volumes=dict(mounts),
            shm_size=dc.shm_size, ulimits=_ulimits(dc.ulimits), device_requests=device_requests or None,
            network_mode=None if network else "host", network=network, user=dc.user, detach=True,
        )
        nodes.append(NodePlan(i, urls[i], {k: v for k, v in kwargs.items() if v is not None}, set(secrets)))
    return LaunchPlan(launch_id, image, network, labels, nodes)


def _device_request(**kwargs):
    from docker.types import DeviceRequest

    return DeviceRequest(capabilities=[["gpu"]], **kwargs)


def _ulimits(limits: dict[str, int]):
    from docker.types import Ulimit

    return [Ulimit(name=name, soft=value, hard=value) for name, value in limits.items()] or None


def describe(node: NodePlan) -> str:
    """One line for the log: where the node runs and what; secrets masked, the spec abbreviated."""
    k = node.kwargs
    env = {name: ("***" if name in node.secrets else "<spec>" if name == "LMYARD_SPEC" else v)
           for name, v in k["environment"].items()}
    gpus = [dict(r) for r in k.get("device_requests", [])]
    return (f"node {node.index} on {node.url}: {k['name']} image={k['image']} "
            f"network={k.get('network') or k.get('network_mode')} shm={k['shm_size']} gpus={gpus or 'none'} "
            f"mounts={sorted(k['volumes'])} env={env} cmd={' '.join(k['command'])}")


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
                raise UserError(f"engine {url}: a tcp:// engine needs TLS; set launch.docker.tls_cert_dir "
                                "(ca.pem, cert.pem, key.pem) or DOCKER_CERT_PATH")
            tls = docker.tls.TLSConfig(client_cert=(f"{cert_dir}/cert.pem", f"{cert_dir}/key.pem"),
                                       ca_cert=f"{cert_dir}/ca.pem", verify=True)
            client = docker.DockerClient(base_url=url, tls=tls, timeout=60)
        else:
            client = docker.DockerClient(base_url=url, timeout=60)
        client.ping()
        return client
    except docker.errors.DockerException as e:
        raise UserError(f"cannot reach the Docker engine {url}: {e}") from None


def remove_leftovers(client, flow_run_id: str, log: Callable[[str], None]) -> int:
    """Remove containers and networks an earlier attempt of this flow run left behind."""
    import docker

    selector = {"label": f"{LABEL}.flow_run_id={flow_run_id}"}
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


# ---------------------------------------------------------------- run and follow

def run_docker(cfg: RunConfig, spec: dict, on_line: Callable[[str], None] = print, *, image: str | None = None,
               flow_run_id: str | None = None, tail_lines: int = 40) -> dict:
    """Run the trainer in one container per node; returns the result line rank 0 prints."""
    import docker

    if image is None:
        from lmyard.images import image_tag

        image = cfg.launch.docker.image or image_tag()
    p = plan(cfg, spec, image=image, flow_run_id=flow_run_id)
    mask = _Masker([v for n in p.nodes for k, v in n.kwargs["environment"].items() if k in n.secrets])
    clients = {url: connect(url, cfg.launch.docker) for url in dict.fromkeys(n.url for n in p.nodes)}
    for url, client in clients.items():
        if flow_run_id:
            remove_leftovers(client, flow_run_id, on_line)
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise UserError(f"image {image} is not on the engine {url}: build it there "
                            "(python -m lmyard.images build) or load it (docker save | docker load)") from None

    containers: list = []
    network = None
    try:
        if p.network:
            network = clients[p.nodes[0].url].networks.create(p.network, driver="bridge", labels=p.labels)
        for node in p.nodes:
            on_line(mask(describe(node)))
            containers.append(clients[node.url].containers.create(**node.kwargs))
        for c in containers:
            c.start()
        return _follow(containers, on_line, mask, tail_lines)
    finally:
        _remove(containers, network)
        for client in clients.values():
            client.close()


def _follow(containers: list, on_line: Callable[[str], None], mask: _Masker, tail_lines: int) -> dict:
    events: queue.Queue = queue.Queue()
    stopping = threading.Event()

    def pump(i: int, c) -> None:
        try:
            buf = b""
            for chunk in c.logs(stream=True, follow=True, stdout=True, stderr=True):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    events.put(("line", i, line.decode(errors="replace")))
            if buf:
                events.put(("line", i, buf.decode(errors="replace")))
            events.put(("exit", i, c.wait()["StatusCode"]))
        except Exception as e:  # noqa: BLE001 - reported to the follower, which decides
            if not stopping.is_set():
                events.put(("error", i, e))

    threads = [threading.Thread(target=pump, args=(i, c), daemon=True, name=f"docker-logs-{i}")
               for i, c in enumerate(containers)]
    for t in threads:
        t.start()

    tails = [collections.deque(maxlen=tail_lines) for _ in containers]  # per node: the failing one's matters
    result: dict | None = None
    user_error: str | None = None
    exits: dict[int, int] = {}
    try:
        while len(exits) < len(containers):
            try:
                kind, i, value = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if kind == "line":
                line = mask(value)
                if line.startswith("result "):
                    result = json.loads(line.removeprefix("result "))
                    continue
                if user_error is None and "lmyard: error:" in line:
                    user_error = line.split("lmyard: error:", 1)[1].strip()
                tails[i].append(f"[node {i}] {line}")
                on_line(f"[node {i}] {line}")
            elif kind == "error":
                raise TrainingFailed(f"lost node {i} ({containers[i].name}): {value}")
            else:
                exits[i] = value
                if value != 0:
                    break
    finally:
        stopping.set()

    failed = {i: code for i, code in exits.items() if code != 0}
    if failed:
        i, code = next(iter(failed.items()))
        if user_error:
            raise UserError(user_error)
        others = [ln for j, t in enumerate(tails) if j != i for ln in list(t)[-5:]]
        raise TrainingFailed(f"node {i} ({containers[i].name}) exited with code {code}{_why(containers[i], code)}; "
                             "stopped the others. Last lines:\n" + "\n".join([*tails[i], *others]))
    if result is None:
        raise TrainingFailed("training exited without a result line; last lines:\n"
                             + "\n".join(ln for t in tails for ln in t))
    return result


def _why(container, code: int) -> str:
    try:
        container.reload()
        if container.attrs["State"].get("OOMKilled"):
            return " (out of memory)"
    except Exception:  # noqa: BLE001 - only decorates the message
        pass
    return " (killed)" if code == 137 else ""


def _remove(containers: list, network) -> None:
    """Kill and remove every container, then the network; each step tolerates what is already gone."""
    import docker

    for c in containers:
        try:
            c.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
    if network is not None:
        try:
            network.remove()
        except docker.errors.NotFound:
            pass
