"""The one local cache root: shards, sources, checkpoint loads, staging, launches (no torch here)."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """LMYARD_CACHE, default ~/.cache/lmyard."""
    return os.environ.get("LMYARD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lmyard"))
