"""The `launch` section: the backend, nodes, ranks, grace and watchdogs, one section `launch.<name>` for each
backend of the table that has one (lmyard.backends: each backend's module declares its section and checks), and
`launch.kubernetes`, which only `lmyard render` reads (lmyard.config.kubernetes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, model_validator

from lmyard.backends import BACKENDS
from lmyard.config.base import _Section
from lmyard.config.kubernetes import KubernetesConfig

if TYPE_CHECKING:
    BackendName = str
else:  # the table's names, so the schema (the Prefect form, docs/config.md) lists them
    BackendName = Literal[tuple(BACKENDS)]


class _Launch(_Section):
    backend: BackendName = Field(
        "local", description="Where the stages run: a name of the backend table (lmyard.backends)."
    )
    nnodes: int = Field(1, gt=0)
    min_nnodes: int | None = Field(
        None,
        gt=0,
        description="Fewest nodes a training run goes on with: when a node is lost and at least this many stay "
        "healthy, training resumes at once on those from the last committed checkpoint (same global batch, same "
        "token stream; docs/multi-host.md). Default: launch.nnodes (a lost node ends the attempt).",
    )
    grow_back: bool = Field(
        True,
        description="After a resize below launch.nnodes: once a lost node is healthy again, commit the step, stop "
        "and relaunch at full size from it. false: finish at the reduced size.",
    )
    nproc_per_node: int = Field(2, gt=0, description="Ranks per node (GPUs per node on CUDA).")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of node 0 for multi-node rendezvous (docker: default from node 0's URL)."
    )
    retries: int = Field(
        1,
        ge=0,
        description="Retries of the train task after a failure that is not a user "
        "error (a dead node, a crashed rank); each resumes from the newest checkpoint.",
    )
    watchdog_s: float | None = Field(
        900, gt=0, description="Kill the job when no step completes for this long (after the first); null: never."
    )
    startup_timeout_s: float | None = Field(
        1800,
        gt=0,
        description="Kill the job when a rank has not completed its first step this long after the job started "
        "(stuck in rendezvous, resume or compile); raise it for big models; null: never.",
    )
    standby: bool | None = Field(
        None,
        description="Warm standbys (the local backend): while an attempt trains, a process per rank and one for "
        "torchrun import torch and its compiler, and the next attempt's torchrun and ranks start in them; a "
        "node's first attempt starts its ranks' beside its torchrun (docs/launch.md). Default: on where training "
        "runs on this machine's NVIDIA GPUs.",
    )
    grace_s: float = Field(
        120,
        gt=0,
        description="After SIGTERM (a spot reclaim, `docker stop`, a cancelled run), the seconds the "
        "trainer has to checkpoint the current step and exit as preempted before it is killed.",
    )

    if TYPE_CHECKING:  # a backend's section, launch.<name>, is a field of LaunchConfig

        def __getattr__(self, name: str) -> Any: ...

    def fewest_nodes(self) -> int:
        """launch.min_nnodes, else launch.nnodes."""
        return self.min_nnodes or self.nnodes

    @model_validator(mode="after")
    def _backend_checks(self) -> _Launch:
        if self.min_nnodes is not None and self.min_nnodes > self.nnodes:
            raise ValueError(
                f"launch.min_nnodes={self.min_nnodes} is above launch.nnodes={self.nnodes}: set it at most that"
            )
        BACKENDS[self.backend].check(self)
        return self


_SECTIONS: dict[str, Any] = {
    name: (b.section, Field(default_factory=b.section, description=b.section.__doc__))
    for name, b in BACKENDS.items()
    if b.section is not None
}
_SECTIONS["kubernetes"] = (
    KubernetesConfig,
    Field(default_factory=KubernetesConfig, description=KubernetesConfig.__doc__),
)
if TYPE_CHECKING:
    LaunchConfig = _Launch
else:
    LaunchConfig = create_model("LaunchConfig", __base__=_Launch, __module__=__name__, **_SECTIONS)
