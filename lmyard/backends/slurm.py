"""The Slurm backend: each stage one Slurm job (`sbatch`), training one job of launch.nnodes nodes with torchrun on
each and the rendezvous at its first node (lmyard.launch.slurm.SlurmJob; docs/slurm.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from lmyard.backends.base import Backend
from lmyard.sections import _Section


class SlurmConfig(_Section):
    """Each stage one Slurm job, submitted with sbatch from this machine (a login node; see docs/slurm.md)."""

    partition: str | None = Field(
        None, description="Partition of the jobs (`sbatch --partition`); default the cluster's."
    )
    account: str | None = Field(None, description="Account charged for the jobs (`sbatch --account`).")
    time_limit: str | None = Field(
        None,
        description="Time limit of each job (`sbatch --time`, e.g. `04:00:00`); Slurm sends SIGTERM launch.grace_s "
        "(plus a minute) before it, so the step is checkpointed.",
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs of each node (`sbatch --gpus-per-node`); 0 runs on the CPU.")
    cpus_per_node: int | None = Field(
        None, gt=0, description="CPUs of each node's task (`--cpus-per-task`); default launch.nproc_per_node."
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="Extra sbatch options, e.g. `['--mem=64G', '--qos=high', '--exclusive']`. Logged with the "
        "config: no secrets here (the environment of the launching process reaches the job instead).",
    )
    container_image: str | None = Field(
        None,
        description="Run each node's task in this image through pyxis/enroot (`srun --container-image`); the job "
        "folder (job_dir) and container_mounts are mounted. Default: the nodes' own environment.",
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="With container_image: extra `src:dst` mounts (`--container-mounts`)."
    )
    pending_timeout_s: float = Field(
        600,
        gt=0,
        description="A job still pending this long is cancelled and the launch ends in one line naming the "
        "partition and squeue's reason.",
    )
    job_dir: str | None = Field(
        None,
        description="A folder every node and this machine see (a shared filesystem), for each job's exchange "
        "folder (spec, output, heartbeats, result); default LMYARD_CACHE, which must then be shared.",
    )
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="c10d rendezvous port on the job's first node.")
    socket_ifname: str | None = Field(
        None, description="Interface(s) for NCCL and gloo traffic (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)."
    )


def check(launch: Any) -> None:
    """One rank per GPU; container mounts only with a container."""
    sc = launch.slurm
    if sc.gpus_per_node and sc.gpus_per_node != launch.nproc_per_node:
        raise ValueError(
            f"launch.slurm.gpus_per_node={sc.gpus_per_node} but launch.nproc_per_node={launch.nproc_per_node}: "
            "one rank per GPU, set them equal"
        )
    if sc.container_mounts and not sc.container_image:
        raise ValueError("launch.slurm.container_mounts needs launch.slurm.container_image")


BACKEND = Backend(name="slurm", job="lmyard.launch.slurm:SlurmJob.for_stage", section=SlurmConfig, check=check)
