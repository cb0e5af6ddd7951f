"""The one MLflow client factory: credentials leave the URI, an operator's timeouts, a server that never answers."""

from __future__ import annotations

import time

import pytest

from lmyard.errors import UserError
from lmyard.tracking.client import OPERATOR_TIMEOUTS, check_reachable, mlflow_client, operator_timeouts


def test_the_client_takes_the_password_out_of_the_uri_into_mlflows_variables(tmp_path):
    environ: dict[str, str] = {}
    client = mlflow_client("http://ann:s3cret@127.0.0.1:1", environ)
    assert client.tracking_uri == "http://127.0.0.1:1"
    assert environ == {"MLFLOW_TRACKING_USERNAME": "ann", "MLFLOW_TRACKING_PASSWORD": "s3cret"}


def test_the_client_makes_the_folder_of_a_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'deep' / 'mlflow.db'}"
    assert mlflow_client(uri, {}).tracking_uri == uri
    assert (tmp_path / "deep").is_dir()


def test_operator_timeouts_leave_the_operators_own_settings():
    environ = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    operator_timeouts(environ)
    assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == OPERATOR_TIMEOUTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]


def test_a_server_that_never_answers_is_one_line_within_its_timeout(silent_server):
    start = time.monotonic()
    with pytest.raises(UserError, match=r"does not answer within 1 s \(ReadTimeout\); start it") as e:
        check_reachable(silent_server, timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert "\n" not in str(e.value) and silent_server in str(e.value)
