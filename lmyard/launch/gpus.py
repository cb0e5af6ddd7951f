"""GPUs in the Docker backend's containers: which GPUs each node gets, how the engine is asked, a preflight.

    gpus = node_gpus(cfg.launch, urls)        # one NodeGpus per container (pure)
    check_engine(client, url, nodes, ...)     # per engine, before any training container starts

Design notes: docs/launch.md, `lmyard/launch/gpus.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lmyard.config import LaunchConfig
from lmyard.errors import UserError

# NVLink multicast (NVLS) is disabled on the lent GPU machines; these keep NCCL, torch's symmetric memory
# and NVSHMEM from trying it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass
class NodeGpus:
    """What one container gets for its GPUs: keyword arguments of `containers.create` and environment
    defaults (launch.docker.env overrides them)."""

    ids: list[str]  # this node's own GPUs; [] for none or a toolkit count
    kwargs: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def assigned(launch: LaunchConfig) -> list[list[str]] | None:
    """Each node's GPU ids (launch.nnodes entries), or None when none are named (no GPUs, or a toolkit count)."""
    dc, n = launch.docker, launch.nnodes
    if dc.node_gpus is not None:
        if len(dc.node_gpus) != n:
            raise UserError(
                f"launch.docker.node_gpus lists {len(dc.node_gpus)} entries for launch.nnodes={n}: "
                "give one per node, e.g. ['0,1', '2,3']"
            )
        return [[g.strip() for g in entry.split(",") if g.strip()] for entry in dc.node_gpus]
    if dc.gpu_ids is not None:
        return [list(dc.gpu_ids)] * n
    if isinstance(dc.gpus, int) and dc.gpus > 0 and dc.gpu_mode != "toolkit":
        return [[str(i) for i in range(dc.gpus)]] * n
    return None


def _engine_gpus(urls: Sequence[str], ids: list[list[str]]) -> dict[str, list[str]]:
    """The GPUs each engine's nodes use, in index order; two nodes of one engine may not share a GPU."""
    owner: dict[tuple[str, str], int] = {}
    for i, (url, mine) in enumerate(zip(urls, ids)):
        for g in mine:
            if (url, g) in owner:
                raise UserError(
                    f"nodes {owner[url, g]} and {i} share the engine {url} and both use GPU {g}: "
                    "give each node its own GPUs with launch.docker.node_gpus, e.g. ['0,1', '2,3']"
                )
            owner[url, g] = i
    out: dict[str, list[str]] = {}
    for url, g in owner:
        out.setdefault(url, []).append(g)
    return {
        url: sorted(gs, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g)) for url, gs in out.items()
    }


def node_gpus(launch: LaunchConfig, urls: Sequence[str]) -> list[NodeGpus]:
    """One NodeGpus per container (len(urls) of them; a one-container stage takes node 0's GPUs)."""
    dc = launch.docker
    ids = assigned(launch)
    if ids is None:
        if dc.gpus == 0:
            return [NodeGpus([]) for _ in urls]
        request = _device_request(dc.gpu_mode, count=-1 if dc.gpus == "all" else dc.gpus)
        return [NodeGpus([], {"device_requests": [request]}, dict(NO_MULTICAST)) for _ in urls]
    ids = ids[: len(urls)]
    engine = _engine_gpus(urls, ids)
    out = []
    for url, mine in zip(urls, ids):
        shared = sum(1 for u, m in zip(urls, ids) if u == url and m) > 1
        given = engine[url] if shared else mine  # every GPU of the engine's nodes, when nodes share it
        env = dict(NO_MULTICAST)
        kwargs: dict = {}
        if shared:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g if not g.isdigit() else str(given.index(g)) for g in mine)
            kwargs.update(pid_mode="host", ipc_mode="host")
        if dc.gpu_mode == "devices":
            kwargs["devices"] = [f"{d}:{d}:rwm" for d in (*CONTROL_DEVICES, *(f"/dev/nvidia{g}" for g in given))]
            kwargs["mounts"] = [_driver_mount(dc.driver_dir)]
            env["LD_LIBRARY_PATH"] = f"{dc.driver_dir}/lib64"
        else:
            kwargs["device_requests"] = [_device_request(dc.gpu_mode, device_ids=given)]
        out.append(NodeGpus(mine, kwargs, env))
    return out


def _device_request(mode: str, *, count: int = 0, device_ids: list[str] | None = None):
    from docker.types import DeviceRequest

    if mode == "cdi":  # CDI names: nvidia.com/gpu=0, =<uuid>, =all
        names = [f"nvidia.com/gpu={g}" for g in device_ids] if device_ids else ["nvidia.com/gpu=all"]
        if device_ids is None and count > 0:
            names = [f"nvidia.com/gpu={i}" for i in range(count)]
        return DeviceRequest(driver="cdi", device_ids=names)
    if device_ids is not None:
        return DeviceRequest(capabilities=[["gpu"]], device_ids=list(device_ids))
    return DeviceRequest(capabilities=[["gpu"]], count=count)


def _driver_mount(driver_dir: str):
    from docker.types import Mount

    return Mount(target=driver_dir, source=driver_dir, type="bind", read_only=True)


# ---------------------------------------------------------------- the engine check


def _missing(explanation: str, mode: str, driver_dir: str) -> str:
    """What the engine's refusal means, in the user's terms."""
    text = str(explanation)
    if "error gathering device information" in text:
        device = text.split('custom device "', 1)[-1].split('"', 1)[0]
        return f"{device} does not exist there (gpu_mode=devices needs the NVIDIA driver's device nodes: `ls /dev/nvidia*` on that host)"
    if "bind source path does not exist" in text:
        return f"the driver folder {driver_dir} does not exist there: set launch.docker.driver_dir"
    if 'device driver "cdi"' in text:
        return "the engine has no CDI support (Docker >= 25 with CDI enabled): use gpu_mode=devices or toolkit"
    if "could not select device driver" in text:
        return "the engine has no NVIDIA container toolkit: install it, or use gpu_mode=devices"
    return f"a container with its GPUs cannot start ({text.strip()})"


def check_engine(client, url: str, nodes: Sequence, image, *, mode: str, driver_dir: str, labels: dict) -> None:
    """Start a throwaway container of `image` with this engine's GPUs; a refusal is a UserError naming the
    nodes and what is missing. Also appends the image's LD_LIBRARY_PATH to the driver's in devices mode.
    `nodes`: the NodePlans of this engine (index, kwargs)."""
    import docker

    gpu_nodes = [n for n in nodes if n.kwargs.get("devices") or n.kwargs.get("device_requests")]
    if not gpu_nodes:
        return
    who = f"node{'s' if len(gpu_nodes) > 1 else ''} {', '.join(str(n.index) for n in gpu_nodes)} on {url}"
    image_env = dict(e.split("=", 1) for e in (image.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
    first = gpu_nodes[0].kwargs
    command = ["true"]
    if mode == "devices":
        command = ["test", "-e", f"{driver_dir}/lib64/libcuda.so.1"]
        for n in gpu_nodes:
            env = n.kwargs["environment"]
            if env.get("LD_LIBRARY_PATH") == f"{driver_dir}/lib64" and image_env.get("LD_LIBRARY_PATH"):
                env["LD_LIBRARY_PATH"] += ":" + image_env["LD_LIBRARY_PATH"]
    spec = {k: first[k] for k in ("devices", "mounts", "device_requests") if k in first}
    container = None
    try:
        container = client.containers.create(
            image.id, command, labels={**labels, "lmyard.node": "gpu-check"}, network_mode="none", **spec
        )
        container.start()
        code = container.wait(timeout=120)["StatusCode"]
    except docker.errors.APIError as e:
        raise UserError(
            f"launch.docker.gpu_mode={mode}: {who}: {_missing(e.explanation or e, mode, driver_dir)}"
        ) from None
    finally:
        if container is not None:
            try:
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass
    if code != 0:
        raise UserError(
            f"launch.docker.gpu_mode={mode}: {who}: no libcuda.so.1 in {driver_dir}/lib64: "
            "set launch.docker.driver_dir to the driver's folder"
            if mode == "devices"
            else f"launch.docker.gpu_mode={mode}: {who}: a container with its GPUs exits {code}"
        )
