"""The base of every config section (`_Section`, from lmyard.sections), and helpers every section shares (names, URIs,
digests)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from lmyard.sections import _Section as _Section  # every section's base, here for the config's modules

# The run name becomes a folder name in the store (255 bytes at most on ext4, xfs, APFS), a part of staging
# and checkpoint folder names with suffixes of their own, and the MLflow run's and registered model's name.
RUN_NAME_MAX = 100

_USERINFO = re.compile(r"(\w[\w+.-]*://[^/\s:@]+):[^/\s]*@")


def redact_uri(uri: str) -> str:
    """`uri` without the password of its `user:password@` part (`http://me:s3cret@host` -> `http://me:***@host`);
    any URI inside a longer text (an error message) too; other strings as they are."""
    return _USERINFO.sub(r"\1:***@", uri)


def digest(obj: Any, n: int = 16) -> str:
    """A short, stable content hash of JSON-able data."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]
