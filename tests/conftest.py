"""Shared fixtures: tiny configs, a Prefect test server shared by the session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
REPO = Path(__file__).resolve().parents[1]


def tiny_overrides(tmp: Path, steps: int = 6, **extra) -> list[str]:
    """`--set` assignments for a fast run: a 2-layer model, small batches, everything under tmp."""
    values = {
        "store": str(tmp / "store"),
        "tracking.uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "train.max_steps": steps,
        "train.warmup_steps": 2,
        "train.batch_tokens": 1024,
        "train.micro_batch": 4,
        "train.log_interval": 1,
        "model.n_layer": 2,
        "model.n_embd": 64,
        "model.n_head": 2,
        "model.block_size": 64,
        "eval.interval": 3,
        "eval.val_tokens": 2048,
        "eval.sample_tokens": 16,
        "checkpoint.interval": 3,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="session")
def prefect_api_url():
    """A real Prefect server for the session (prefect_test_harness); its API URL for subprocesses too."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture
def cli_env(prefect_api_url, tmp_path):
    """Environment for `lmyard` subprocesses: the session's Prefect server, a private cache."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "LMYARD_CACHE": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_HOME", None)
    return env


def lmyard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]
