"""Simulated hosts on one machine: network namespaces joined by a bridge, each with its own hostname, its own
LMYARD_CACHE and, where asked, its own Docker engine; a services host carries the image registry (and what
else a test starts there: the S3 server, MLflow).

    with Hosts(tmp, ["a", "b"], docker=True, registry=True) as hosts:
        hosts["a"].addr, hosts["a"].docker_url, hosts.services.addr, hosts.registry
        hosts["b"].run(["hostname"]).stdout

Layout, for a prefix P unique to the harness (e.g. `lyh3f2a1c`):

- `P-sw`, the switch: a namespace holding the bridge `br0`; host k's veth pair is `pk` there, `eth0` in the host.
- `P-svc` (10.213.0.1), `P-a` (10.213.0.2), ...: one namespace per host, loopback up, `eth0` in 10.213.0.0/24.
  The root namespace gets no link and no address of the harness: test addresses exist only in the namespaces
  made here (so two harnesses alive at once do not collide).
- Processes in a host run under `nsenter --net=/run/netns/P-x unshare --uts --mount` with the host's name set
  first: a Docker engine started that way gives its host-network containers that hostname, and its mounts
  stay in its own mount namespace.
- A host's engine: `dockerd` with its own data-root (under the harness folder), exec-root, pidfile and socket
  (`/run/lmyard-hosts/P/x.sock`), no bridge, no iptables, the registry as an insecure one.
- A host's Ray node (`start_ray`): `ray start --block` at the host's address, in a PID namespace of its own (so
  `ray stop` there ends only that node, and nothing of it outlives its first process) with a private /tmp/ray
  (the session folders of two hosts on one machine do not meet); `in_ray` runs a command beside it (a driver).
- `forward(host, port)`: a port on this machine's 127.0.0.1 that reaches host:port, through a relay on a unix
  socket (tests/tcp_proxy.py) started inside the host; the way for the root namespace (its engine pushing to
  the registry, the test reading S3) to reach a server that only has a test address.

`close()` removes everything on failure too: containers, engines, relays, servers, every process left in a
namespace of the harness, the namespaces (their links go with them), the engines' folders; `leftovers()` lists
what is still there (nothing, after close).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from tcp_proxy import TcpProxy

SUBNET = "10.213.0"
REGISTRY_PORT = 5000
RAY_PORT = 6379
RAY = str(Path(sys.executable).with_name("ray"))  # Ray's command, beside this Python (a virtual environment's)
RUN_DIR = Path("/run/lmyard-hosts")  # short paths: a unix socket's path is limited to 107 bytes
IN_HOST = 'hostname "$0" && exec "$@"'  # sh -c: set this UTS namespace's hostname, then run the command


class HostsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no `ip`), or a program a test asked for is missing."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=60)


def check_available(docker: bool = False, registry: bool = False) -> None:
    """Raise HostsUnavailable with the reason when namespaces (or the programs asked for) cannot be had."""
    if os.geteuid() != 0:
        raise HostsUnavailable("simulated hosts need root (network namespaces)")
    needed = ["ip", "nsenter", "unshare"] + (["dockerd"] if docker else []) + (["docker-registry"] if registry else [])
    if missing := [p for p in needed if shutil.which(p) is None]:
        raise HostsUnavailable(f"simulated hosts need {', '.join(missing)} (iproute2, util-linux, docker.io, ...)")
    probe = f"lyhprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        raise HostsUnavailable(f"`ip netns add` fails here: {made.stderr.strip()}")


def require_hosts(docker: bool = False, registry: bool = False) -> None:
    """In a test: skip with the reason when simulated hosts cannot be had, or fail under LMYARD_REQUIRE_HOSTS=1
    (.ci/run sets it)."""
    import pytest

    try:
        check_available(docker, registry)
    except HostsUnavailable as e:
        if os.environ.get("LMYARD_REQUIRE_HOSTS") == "1":
            pytest.fail(f"LMYARD_REQUIRE_HOSTS=1 but {e}")
        pytest.skip(str(e))


class Host:
    """One simulated host: a namespace, a hostname, an address, an LMYARD_CACHE, maybe a Docker engine."""

    def __init__(self, harness: Hosts, name: str, index: int):
        self.harness, self.name = harness, name
        self.netns = f"{harness.prefix}-{name}"
        self.hostname = f"host-{name}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.link = f"p{index}"  # its veth's end on the switch
        self.root = harness.root / name
        self.cache = self.root / "cache"
        self.docker_url: str | None = None
        self.dockerd: subprocess.Popen | None = None
        self.ray: subprocess.Popen | None = None

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "LMYARD_CACHE": str(self.cache), **(extra or {})}

    def argv(self, cmd: list[str], resolvable: bool = False) -> list[str]:
        """`cmd` as run inside this host: its network namespace, a UTS namespace with its hostname, a private mount
        namespace (what an engine mounts goes away with it). Not `ip netns exec`: it mounts a new /sys, which
        hides the cgroup mounts a Docker engine needs. `resolvable`: an /etc/hosts of its own that resolves the
        host's name to its address, as a real host's DNS would (torchrun's standalone rendezvous needs it)."""
        netns = f"--net=/run/netns/{self.netns}"
        setup = IN_HOST
        if resolvable:
            (hosts := self.root / "etc-hosts").write_text(f"127.0.0.1 localhost\n{self.addr} {self.hostname}\n")
            setup = f"mount --bind {hosts} /etc/hosts && {IN_HOST}"
        return ["nsenter", netns, "unshare", "--uts", "--mount", "sh", "-c", setup, self.hostname, *cmd]

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), env=self.env(env), capture_output=True, text=True, timeout=timeout)

    def start(
        self, cmd: list[str], log_name: str, env: dict[str, str] | None = None, resolvable: bool = False
    ) -> subprocess.Popen:
        """A long-running process in this host (its own process group), ended by the harness's close()."""
        log = open(self.root / log_name, "w")
        proc = subprocess.Popen(
            self.argv(cmd, resolvable), env=self.env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.harness.procs.append(proc)
        return proc

    def wait_for_port(self, port: int, proc: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
        """Poll this host's addr:port from inside the host until it accepts; fail with the log's tail otherwise."""
        poll = (
            "import socket, sys, time\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        socket.create_connection(({self.addr!r}, {port}), timeout=2).close(); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.2)\n"
            "sys.exit(1)\n"
        )
        if self.run([sys.executable, "-c", poll], timeout=timeout_s + 30).returncode != 0:
            raise RuntimeError(f"{self.name}: nothing answers at {self.addr}:{port} (see the logs under {self.root})")

    def start_dockerd(self, insecure_registry: str) -> None:
        run = self.harness.run_dir
        (self.root / "docker").mkdir(parents=True, exist_ok=True)
        (self.root / "daemon.json").write_text("{}\n")  # not the machine's /etc/docker/daemon.json
        sock = run / f"{self.name}.sock"
        self.dockerd = self.start(
            [
                "dockerd",
                "--config-file",
                str(self.root / "daemon.json"),
                "--data-root",
                str(self.root / "docker"),
                "--exec-root",
                str(run / self.name),
                "--pidfile",
                str(run / f"{self.name}.pid"),
                "-H",
                f"unix://{sock}",
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                "--ip-masq=false",
                "--insecure-registry",
                insecure_registry,
            ],  # fmt: skip
            "dockerd.log",
        )
        self.docker_url = f"unix://{sock}"

    def wait_for_dockerd(self, timeout_s: float = 120) -> None:
        import time

        import docker

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with contextlib.closing(docker.DockerClient(base_url=self.docker_url, timeout=10)) as c:
                    c.ping()
                    return
            except docker.errors.DockerException:
                if self.dockerd is None or self.dockerd.poll() is not None or time.monotonic() > deadline:
                    tail = (self.root / "dockerd.log").read_text()[-2000:]
                    raise RuntimeError(f"{self.name}: dockerd did not answer:\n{tail}") from None
                time.sleep(0.3)

    def stop_dockerd(self, timeout_s: float = 120) -> None:
        """SIGTERM to this host's engine (it stops its containers first) and wait for it to exit."""
        assert self.dockerd is not None
        self.dockerd.send_signal(signal.SIGTERM)
        self.dockerd.wait(timeout=timeout_s)

    def restart_dockerd(self) -> None:
        """Start this host's engine again after stop_dockerd: the same data-root (its images are still there)."""
        self.start_dockerd(self.harness.registry or f"{self.harness.services.addr}:{REGISTRY_PORT}")
        self.wait_for_dockerd()

    # ------------------------------------------------------------ a Ray node

    def start_ray(self, head: Host | None = None, num_cpus: int = 1, timeout_s: float = 180) -> None:
        """This host's Ray node, the head (no dashboard) when `head` is None, else a node joining `head`'s GCS;
        `num_cpus` CPUs. Returns once `ray start` says the node runs; fails with its log's tail otherwise."""
        join = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        if head is not None:
            join = [f"--address={head.addr}:{RAY_PORT}"]
        cmd = [RAY, "start", "--block", *join, f"--node-ip-address={self.addr}", f"--num-cpus={num_cpus}"]
        private_tmp = "mkdir -p /tmp/ray && mount -t tmpfs -o size=1g ray /tmp/ray && "
        argv = ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--uts", "--mount", "--pid", "--fork"]
        argv += ["--mount-proc", "sh", "-c", 'hostname "$0" && ' + private_tmp + 'exec "$@"', self.hostname]
        log = open(self.root / "ray.log", "w")
        self.ray = subprocess.Popen(
            [*argv, *cmd, "--disable-usage-stats"], env=self.env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        self.harness.procs.append(self.ray)
        import time

        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in (self.root / "ray.log").read_text():
            if self.ray.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "ray.log").read_text()[-2000:]
                raise RuntimeError(f"{self.name}: its Ray node did not start:\n{tail}")
            time.sleep(0.3)

    def ray_pid(self) -> int:
        """The first process of this host's Ray PID namespace (`ray start --block`), as this machine numbers it."""
        import time

        assert self.ray is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.ray.pid}/task/{self.ray.pid}/children")
            with contextlib.suppress(OSError):
                if found := children.read_text().split():
                    return int(found[0])
            if self.ray.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: its Ray node did not start (see {self.root / 'ray.log'})")

    def in_ray(self, cmd: list[str]) -> list[str]:
        """`cmd` as run beside this host's Ray node: its network, name, mounts (/tmp/ray) and PIDs."""
        return ["nsenter", f"--target={self.ray_pid()}", "--net", "--uts", "--mount", "--pid", *cmd]

    def stop_ray(self, timeout_s: float = 120) -> None:
        """`ray stop` in this host's Ray PID namespace (it sees that node's processes only), then SIGKILL to the
        namespace's first process, `ray start --block`, which `ray stop` leaves waiting: what is left of the
        namespace ends with it."""
        if self.ray is None or self.ray.poll() is not None:
            return
        first = self.ray_pid()
        subprocess.run(self.in_ray([RAY, "stop"]), env=self.env(), capture_output=True, timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.ray.wait(timeout=timeout_s)

    def docker(self):
        import docker

        return docker.DockerClient(base_url=self.docker_url, timeout=600)


class Hosts:
    """The hosts `names` and a services host `svc` (see the module's docstring); a context manager."""

    def __init__(self, tmp: Path, names: list[str], *, docker: bool = False, registry: bool = False):
        self.prefix = f"lyh{uuid.uuid4().hex[:7]}"
        self.root = Path(tmp) / self.prefix
        self.run_dir = RUN_DIR / self.prefix
        self.switch = f"{self.prefix}-sw"
        self.services = Host(self, "svc", 0)
        self.hosts = [Host(self, name, i + 1) for i, name in enumerate(names)]
        self.docker, self.with_registry = docker, registry
        self.procs: list[subprocess.Popen] = []
        self.proxies: list[TcpProxy] = []
        self.registry = f"{self.services.addr}:{REGISTRY_PORT}" if registry else None
        self.net_inodes: dict[int, str] = {}  # each namespace of ours, by inode: what a process left in it shows

    def __getitem__(self, name: str) -> Host:
        return next(h for h in [self.services, *self.hosts] if h.name == name)

    def __enter__(self) -> Hosts:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        check_available(self.docker, self.with_registry)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.switch)
        self.net_inodes[os.stat(f"/run/netns/{self.switch}").st_ino] = self.switch
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        for dev in ("lo", "br0"):
            _ip("-n", self.switch, "link", "set", dev, "up")
        for k, host in enumerate([self.services, *self.hosts]):
            host.cache.mkdir(parents=True, exist_ok=True)
            _ip("netns", "add", host.netns)
            self.net_inodes[os.stat(f"/run/netns/{host.netns}").st_ino] = host.netns
            _ip("-n", self.switch, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("-n", self.switch, "link", "set", f"p{k}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                _ip("-n", host.netns, "link", "set", dev, "up")
        if self.with_registry:
            self.start_registry()
        if self.docker:
            for host in self.hosts:
                host.start_dockerd(self.registry or f"{self.services.addr}:{REGISTRY_PORT}")
            for host in self.hosts:
                host.wait_for_dockerd()
        if self.with_registry:
            self.services.wait_for_port(REGISTRY_PORT)

    def start_registry(self) -> None:
        """Debian's docker-registry in the services host, storing under the harness folder."""
        svc = self.services
        config = {
            "version": 0.1,
            "log": {"level": "warn"},
            "storage": {"filesystem": {"rootdirectory": str(svc.root / "registry")}, "delete": {"enabled": True}},
            "http": {"addr": self.registry},
        }
        (svc.root / "registry.yml").write_text(json.dumps(config))  # JSON is YAML
        svc.start(["docker-registry", "serve", str(svc.root / "registry.yml")], "registry.log")

    def set_link(self, host: Host, up: bool) -> None:
        """Cut (`up=False`) or restore host's link to the switch: what a pulled cable or a dead port does; its
        processes keep running, and the engine's socket (a local path) keeps answering."""
        _ip("-n", self.switch, "link", "set", host.link, "up" if up else "down")

    def forward(self, host: Host, port: int) -> int:
        """A port on this machine's 127.0.0.1 reaching host.addr:port (relays through a unix socket)."""
        sock = self.run_dir / f"fwd-{host.name}-{port}.sock"
        relay = Path(__file__).with_name("tcp_proxy.py")
        proc = host.start([sys.executable, str(relay), "--unix", str(sock), f"{host.addr}:{port}"], f"fwd-{port}.log")
        import time

        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the relay to {host.name}:{port} did not start")
            time.sleep(0.1)
        proxy = TcpProxy(str(sock))
        proxy.start()
        self.proxies.append(proxy)
        return proxy.port

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for host in self.hosts:
            if host.dockerd is not None and host.dockerd.poll() is None:
                with contextlib.suppress(Exception), contextlib.closing(host.docker()) as client:
                    for c in client.containers.list(all=True):
                        c.remove(force=True, v=True)
        for host in reversed(self.hosts):  # `ray stop` on each node, the head last
            with contextlib.suppress(Exception):
                host.stop_ray()
        _end_all(self.procs, grace_s=30)  # servers, relays and engines at once (SIGTERM: engines stop cleanly)
        for ns in self._namespaces():  # whatever still runs in a namespace of ours (shims, stray children)
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _namespaces(self) -> list[str]:
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        return [line.split()[0] for line in listed if line.startswith(f"{self.prefix}-")]

    def leftovers(self) -> list[str]:
        """What of this harness is still there: namespaces, links or addresses in the root namespace, live
        processes, mounts, folders. Empty after close()."""
        left = [f"namespace {ns}" for ns in self._namespaces()]
        if f"inet {SUBNET}." in _ip("-o", "addr", check=False).stdout:
            left.append(f"an address in {SUBNET}.0/24 in the root namespace")
        left += [f"root-namespace link {line.split()[1]}" for line in _ip("-o", "link").stdout.splitlines()
                 if self.prefix in line]  # fmt: skip
        left += [f"process {p.pid} ({' '.join(p.args[9:11])})" for p in self.procs if p.poll() is None]
        left += [f"process {pid} ({comm}) in {ns}" for pid, comm, ns in self._processes_in_namespaces()]
        with open("/proc/self/mountinfo") as f:
            left += [f"mount {line.split()[4]}" for line in f if self.prefix in line]
        left += [f"folder {d}" for d in (self.root, self.run_dir) if d.exists()]
        return left

    def _processes_in_namespaces(self) -> list[tuple[int, str, str]]:
        """Every process of this machine in a network namespace of ours, even one whose name is deleted (a Ray
        node's raylet or a training rank that outlived the teardown would show here): pid, name, namespace."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if (ns := self.net_inodes.get(os.stat(proc / "ns" / "net").st_ino)) is not None:
                    found.append((int(proc.name), (proc / "comm").read_text().strip(), ns))
        return found


def _end_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every process group, `grace_s` for all of them together, then SIGKILL to what is left."""
    import time

    def signal_all(sig: int) -> None:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    signal_all(signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
