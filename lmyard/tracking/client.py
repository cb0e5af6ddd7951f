"""The one place an MlflowClient is made: its URI, credentials and timeouts.

`mlflow_client(uri)` is every MLflow client of lmyard (the lineage's, the trainer's sink, the registry's, the
operator commands'). A `user:password@` in the URI moves to MLflow's MLFLOW_TRACKING_USERNAME/PASSWORD
(lmyard.tracking.credentials), so no client, log line or link carries it. MLflow reads its HTTP timeouts and
retries from the environment at each request: a training process keeps MLflow's patient defaults (a tracking
outage never fails training, lmyard.tracking.sink), an operator command calls `operator_timeouts()` first, so a
server that does not answer ends it within seconds; `check_reachable` says so in one line before anything slow.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping

from lmyard.config import redact_uri
from lmyard.errors import UserError
from lmyard.tracking.credentials import PASSWORD, USERNAME, split_credentials

# an operator command's MLflow requests: 10 s each, one retry (2 s back-off): a dead server is said in ~25 s at
# worst, after check_reachable's 5 s probe has already said it for a server that never answers
OPERATOR_TIMEOUTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
REACHABLE_TIMEOUT_S = 5.0  # the /health probe: any HTTP answer within it counts as reachable


def mlflow_client(uri: str, environ: MutableMapping[str, str] = os.environ):
    """An MlflowClient on tracking (and registry) URI `uri`; a sqlite file's folder is made first."""
    from mlflow.tracking import MlflowClient

    uri, user, password = split_credentials(uri)
    if password is not None:
        environ[USERNAME], environ[PASSWORD] = user or "", password
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return MlflowClient(uri, registry_uri=uri)


def operator_timeouts(environ: MutableMapping[str, str] = os.environ) -> None:
    """MLflow's request timeout and retries for a command an operator waits on; the operator's own settings win."""
    for key, value in OPERATOR_TIMEOUTS.items():
        environ.setdefault(key, value)


def check_reachable(uri: str, timeout_s: float = REACHABLE_TIMEOUT_S) -> None:
    """Fail in seconds, with one line, when an http(s) tracking server does not answer at all (MLflow's own
    client would retry for minutes). Any HTTP answer counts as reachable; other URIs are not checked."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(f"{split_credentials(uri)[0].rstrip('/')}/health", timeout=timeout_s)
    except requests.RequestException as e:
        raise UserError(
            f"tracking.uri {redact_uri(uri)}: the MLflow server does not answer within {timeout_s:.0f} s "
            f"({type(e).__name__}); start it, or point tracking.uri (--tracking-uri) at a running server"
        ) from None


@contextlib.contextmanager
def tracking_errors(uri: str, what: str, fix: str) -> Iterator[None]:
    """An operator command's MLflow request failing (`what` was not there, or the server failed it after its
    retries) as one line naming `fix`, not MLflow's traceback."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        missing = e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")
        said = "is not there" if missing else f"failed ({(str(e.message).splitlines() or ['no detail'])[0][:160]})"
        raise UserError(f"tracking.uri {redact_uri(uri)}: {what} {said}; {fix}") from None
