"""The tracking server's password travels in the environment, never in a config.

Design notes: docs/tracking.md, `lmyard/tracking/credentials.py`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from urllib.parse import unquote, urlsplit, urlunsplit

from lmyard.config import RunConfig

USERNAME, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(uri without its user:password@, user, password); user and password None when the URI has no password."""
    parts = urlsplit(uri)
    if parts.password is None or "@" not in parts.netloc:
        return uri, None, None
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=host)), unquote(parts.username or ""), unquote(parts.password)


def credentials_to_env(config: RunConfig, environ: MutableMapping[str, str] = os.environ) -> RunConfig:
    """`config` with the user and password of tracking.uri moved to MLFLOW_TRACKING_USERNAME/PASSWORD in
    `environ`; `config` itself when its URI carries none."""
    uri, user, password = split_credentials(config.tracking.uri)
    if password is None:
        return config
    environ[USERNAME], environ[PASSWORD] = user or "", password
    return config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": uri})})
