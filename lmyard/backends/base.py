"""What a backend is: one entry of the backend table (lmyard.backends), declared by the backend's own module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


def _no_checks(launch: Any) -> None:
    """A backend with nothing to check across its section and the rest of `launch`."""


@dataclass(frozen=True)
class Backend:
    """One value of `launch.backend`.

    `job`: `module:name` of what makes its Job (lmyard.launch.job.JobFactory, a Job class or a classmethod),
    imported by the launcher when a stage runs (the Jobs live above the config in the layer order).
    `section`: its config section, `launch.<name>` (None: it has none). `check`: its checks of the whole launch
    section (a ValueError's one line names the field and the fix), run when `launch.backend` names it.
    `on_ray`: its stages run on a Ray cluster (tokenize-and-shard reads its pieces as Ray tasks, a sweep's
    trials run under Ray Tune). `other_user`: its stages write a local folder of the flow's as another user (a
    container's), so the flow opens the folder to them. `members`: `module:name` of its nodes' health and a
    launch's config on some of them, for a training that goes on without a lost node (lmyard.launch.elastic).
    `on_flow_host`: its stages are processes of the flow's own machine (a Kubernetes work pool's pod then runs
    them itself: lmyard.launch.kubernetes)."""

    name: str
    job: str
    section: type[BaseModel] | None = None
    check: Callable[[Any], None] = _no_checks
    on_ray: bool = False
    other_user: bool = False
    members: str = "lmyard.launch.elastic:Members"  # `module:name`: which of its nodes are healthy (elasticity)
    on_flow_host: bool = False
