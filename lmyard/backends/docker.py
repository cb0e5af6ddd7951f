"""The Docker backend: one container per node in the stage image, on each node's Docker engine
(lmyard.launch.docker_job.DockerJob; docs/docker.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from lmyard.backends.base import Backend
from lmyard.sections import _Section


class DockerConfig(_Section):
    """One container per node, through the Docker engine of each node (see docs/docker.md)."""

    nodes: list[str] = Field(
        default_factory=lambda: ["unix:///var/run/docker.sock"],
        min_length=1,
        description="Docker engine URL of each node: unix:///var/run/docker.sock, tcp://host:2376 (TLS), "
        "ssh://user@host. One URL puts every node on that engine.",
    )
    image: str | None = Field(
        None,
        description="Stage image; default lmyard-stage:<code version> "
        "(built by `python -m lmyard.launch.images build`), under `registry` when that is set. An image from a "
        "registry is pinned to its digest and pulled by every engine that lacks it, before any container starts.",
    )
    registry: str | None = Field(
        None,
        description="Image registry (host[:port]) the stage image was pushed to "
        "(`python -m lmyard.launch.images build --push REGISTRY`); the default image is then "
        "REGISTRY/lmyard-stage:<code version>.",
    )
    node_addrs: list[str] | None = Field(
        None,
        description="The address of each node's host as the other nodes reach it, one per node of launch.nnodes "
        "(torchrun's --local_addr; node 0's is the rendezvous host unless launch.rdzv_endpoint is set). "
        "Default: the host of each engine URL (loopback aliases for nodes on one local engine).",
    )
    network: Literal["host", "bridge"] = Field(
        "host",
        description="`host`: the host's network (NCCL across hosts); `bridge`: a user-defined bridge "
        "network made for the run, for nodes that share one engine.",
    )
    gpus: int | Literal["all"] = Field(
        0, description="GPUs per node (NVIDIA container toolkit): a count or `all`; 0 runs on the CPU."
    )
    gpu_ids: list[str] | None = Field(None, description="GPU indices or UUIDs per node, instead of a count.")
    node_gpus: list[str] | None = Field(
        None,
        description="GPUs of each node, one entry per node of launch.nnodes, e.g. `['0,1', '2,3']` for two "
        "nodes sharing a host; instead of gpus / gpu_ids.",
    )
    gpu_mode: Literal["toolkit", "devices", "cdi"] = Field(
        "toolkit",
        description="How containers get their GPUs: `toolkit`, a device request the NVIDIA container toolkit "
        "serves (`--gpus`); `devices`, the device nodes and the driver folder (driver_dir) without the toolkit; "
        "`cdi`, CDI device names (nvidia.com/gpu=N) on an engine with CDI enabled.",
    )
    driver_dir: str = Field(
        "/usr/local/nvidia",
        description="gpu_mode=devices: the host's NVIDIA driver folder (lib64/libcuda.so.1), mounted read-only "
        "at the same path and its lib64 put first on LD_LIBRARY_PATH.",
    )
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="c10d rendezvous port on node 0.")
    socket_ifname: str | None = Field(
        None,
        description="Interface(s) for NCCL and gloo traffic (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), "
        "e.g. `eth0` or `^docker0,lo`.",
    )
    shm_size: str = Field("16g", description="/dev/shm size (DataLoader workers and NCCL use it).")
    ulimits: dict[str, int] = Field(
        default_factory=lambda: {"memlock": -1, "stack": 64 << 20},
        description="Container ulimits, soft = hard (-1: unlimited). memlock unlimited lets NCCL/InfiniBand "
        "pin memory; an engine without CAP_SYS_RESOURCE can only lower it.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment (e.g. NCCL_IB_HCA, NCCL_DEBUG). Logged with the "
        "config: never put secrets here; name them in pass_env.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the launching process passed to the containers, "
        "besides every AWS_* one (e.g. MLFLOW_TRACKING_TOKEN); their values are never logged.",
    )
    volumes: list[str] = Field(
        default_factory=list,
        description="Extra bind mounts `host:container[:ro]`. "
        "A local-folder store is mounted at its own path without being listed.",
    )
    user: str | None = Field(
        None,
        description="uid[:gid] in the containers; default the image's non-root "
        "user (uid 1000), which must be able to write a local-folder store.",
    )
    tls_cert_dir: str | None = Field(
        None, description="ca.pem, cert.pem, key.pem for tcp:// engines; default DOCKER_CERT_PATH."
    )

    @model_validator(mode="after")
    def _check(self) -> DockerConfig:
        if self.gpu_ids is not None and self.gpus != 0:
            raise ValueError("set launch.docker.gpus or launch.docker.gpu_ids, not both")
        if self.node_gpus is not None and (self.gpu_ids is not None or self.gpus != 0):
            raise ValueError("set one of launch.docker.gpus, gpu_ids, node_gpus, not several")
        if self.node_gpus is not None and not all(g.strip(" ,") for g in self.node_gpus):
            raise ValueError("launch.docker.node_gpus has an empty entry: give each node its GPUs, e.g. ['0,1', '2,3']")
        if self.gpu_mode == "devices" and self.gpus == "all":
            raise ValueError("launch.docker.gpu_mode=devices needs GPU indices: set gpus=N, gpu_ids or node_gpus")
        ids = [g.strip() for g in [*(self.gpu_ids or []), *",".join(self.node_gpus or []).split(",")] if g.strip()]
        if self.gpu_mode == "devices" and (bad := [g for g in ids if not g.isdigit()]):
            raise ValueError(f"launch.docker.gpu_mode=devices names GPUs by index (0, 1, ...), not {bad[0]!r}")
        if isinstance(self.gpus, int) and self.gpus < 0:
            raise ValueError("launch.docker.gpus must be >= 0 or `all`")
        if self.network == "bridge" and len(set(self.nodes)) > 1:
            raise ValueError("launch.docker.network=bridge needs every node on one engine; use `host` across hosts")
        return self


def check(launch: Any) -> None:
    """launch.docker against launch.nnodes: one engine per node (or one for all), one address per node."""
    if len(launch.docker.nodes) not in (1, launch.nnodes):
        raise ValueError(
            f"launch.docker.nodes lists {len(launch.docker.nodes)} engines for launch.nnodes="
            f"{launch.nnodes}: give one URL per node, or one for all"
        )
    addrs = launch.docker.node_addrs
    if addrs is not None and len(addrs) != launch.nnodes:
        raise ValueError(
            f"launch.docker.node_addrs lists {len(addrs)} addresses for launch.nnodes={launch.nnodes}: "
            "give one per node"
        )
    urls = launch.docker.nodes * (launch.nnodes // len(launch.docker.nodes))
    remote = [u for u in urls if not u.startswith("unix://")]
    if launch.docker.network == "host" and len(remote) != len(set(remote)):
        raise ValueError(
            "launch.docker.nodes puts several nodes on one remote engine with host networking, "
            "where they would share one address: list one host per node, or use network=bridge"
        )


BACKEND = Backend(
    name="docker",
    job="lmyard.launch.docker_job:DockerJob",
    section=DockerConfig,
    check=check,
    other_user=True,
    members="lmyard.launch.elastic:DockerMembers",
)
