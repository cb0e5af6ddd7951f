"""The backend table: `launch.backend`'s name -> its `Backend` (lmyard.backends.base): its Job, its config
section `launch.<name>`, its checks and what the flow does differently on it. The backend string is
compared here only: everything else asks `of(config)`.

A backend outside lmyard is one module (its BACKEND) and one entry point of group `lmyard.backends` in its
package's metadata (tests/fixtures/example_backend); docs/architecture.md, "Adding a backend"."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from lmyard.backends import docker, local, ray, slurm
from lmyard.backends.base import Backend

GROUP = "lmyard.backends"

BACKENDS: dict[str, Backend] = {
    "local": local.BACKEND,
    "docker": docker.BACKEND,
    "ray": ray.BACKEND,
    "slurm": slurm.BACKEND,
}


def _installed() -> dict[str, Backend]:
    """The backends of installed packages (entry points of GROUP), each by its name."""
    found = {}
    for point in entry_points(group=GROUP):
        backend = point.load()
        if not isinstance(backend, Backend) or backend.name != point.name or point.name in BACKENDS:
            raise ImportError(
                f"entry point {point.name} = {point.value} of group {GROUP} is not a new lmyard.backends.base."
                "Backend of that name: point it at the module's BACKEND"
            )
        found[point.name] = backend
    return found


BACKENDS.update(_installed())


def of(config: Any) -> Backend:
    """The backend of a RunConfig (its launch.backend, which validation has checked is in the table)."""
    return BACKENDS[config.launch.backend]


def named(name: str) -> Backend:
    """The backend called `name`."""
    return BACKENDS[name]
