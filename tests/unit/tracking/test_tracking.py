"""The MLflow tracking URI: the environment's is the default, an explicit one wins (tracking on a sqlite store:
tests/integration/test_tracking_integration.py)."""

from __future__ import annotations


def test_mlflow_tracking_uri_from_the_environment_is_the_default_and_an_explicit_one_wins(tmp_path):
    import os
    import subprocess

    import yaml
    from conftest import lmyard_cmd

    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://mlflow.platform:5000"}
    shown = subprocess.run(lmyard_cmd("config"), env=env, capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(shown)["tracking"]["uri"] == "http://mlflow.platform:5000"
    explicit = lmyard_cmd("config", "--set", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}")
    shown = subprocess.run(explicit, env=env, capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(shown)["tracking"]["uri"] == f"sqlite:///{tmp_path / 'm.db'}"
    env.pop("MLFLOW_TRACKING_URI")
    shown = subprocess.run(lmyard_cmd("config"), env=env, capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(shown)["tracking"]["uri"] == "sqlite:///.lmyard/mlflow.db"
