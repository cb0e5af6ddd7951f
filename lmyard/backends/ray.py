"""The Ray backend: every stage on a Ray cluster's node, training as one actor per node in a placement group
(lmyard.launch.ray.RayJob; docs/ray.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from lmyard.backends.base import Backend
from lmyard.sections import _Section

# the public keys of Ray's RuntimeEnv (ray.runtime_env.RuntimeEnv.known_fields, less its private ones, plus nsight
# and rocprof_sys, which it takes under those names); tests/unit/config/test_config_errors.py checks them against Ray's
RUNTIME_ENV_KEYS = frozenset(
    {
        "conda", "config", "container", "env_vars", "excludes", "image_uri", "java_jars", "nsight", "pip",
        "py_executable", "py_modules", "rocprof_sys", "uv", "worker_process_setup_hook", "working_dir",
    }
)  # fmt: skip


class RayConfig(_Section):
    """One actor per node in a placement group of a Ray cluster (see docs/ray.md)."""

    address: str | None = Field(
        None,
        description="The Ray cluster's address (host:port of the head's GCS, or `auto`); "
        "default RAY_ADDRESS, else `auto` (the cluster this machine belongs to).",
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs of each node's bundle; 0 runs on the CPU.")
    cpus_per_node: float | None = Field(
        None, gt=0, description="CPUs of each node's bundle; default launch.nproc_per_node (one per rank)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom resources of each node\'s bundle, e.g. `{"accelerator_type:H100": 1}`.',
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env of the node actors (env_vars, pip, image_uri, ...); empty: the nodes' "
        "own environment (a cluster started from the stage image). Logged with the config: no secrets here.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the launching process passed to torchrun on every node, "
        "besides every AWS_* one (e.g. MLFLOW_TRACKING_TOKEN); their values are never logged.",
    )
    placement_timeout_s: float = Field(
        600, gt=0, description="How long to wait for the placement group and the actors (a busy cluster)."
    )

    @field_validator("runtime_env")
    @classmethod
    def _known_runtime_env(cls, env: dict[str, Any]) -> dict[str, Any]:
        """Ray's own keys only, env_vars' values strings: a YAML slip is one line here, not a TypeError of Ray's
        when the actors start."""
        if unknown := sorted(set(env) - RUNTIME_ENV_KEYS):
            raise ValueError(f"unknown key {unknown[0]!r}; Ray's keys: {', '.join(sorted(RUNTIME_ENV_KEYS))}")
        variables = env.get("env_vars", {})
        if not isinstance(variables, dict):
            raise ValueError("env_vars must map names to strings, e.g. {env_vars: {NCCL_SOCKET_IFNAME: eth0}}")
        if bad := [k for k, v in variables.items() if not isinstance(v, str)]:
            raise ValueError(
                f"env_vars.{bad[0]} is {variables[bad[0]]!r}, not a string: give it a value, quoted in YAML "
                f'(e.g. {bad[0]}: "1"), or remove it'
            )
        return env


BACKEND = Backend(
    name="ray",
    job="lmyard.launch.ray:RayJob.for_stage",
    section=RayConfig,
    on_ray=True,
    members="lmyard.launch.elastic:RayMembers",
)
