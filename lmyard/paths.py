"""Where lmyard keeps local files, and keys that must stay inside their folder.

Every node-local cache (shards read by the trainer, source files fetched from
S3, checkpoints being loaded, checkpoints staged for upload, image builds)
lives under one root: `LMYARD_CACHE`, default `~/.cache/lmyard`.
"""

from __future__ import annotations

import os
import posixpath

from lmyard.errors import UserError


def cache_root(*parts: str) -> str:
    """`LMYARD_CACHE` (default ~/.cache/lmyard), joined with `parts`."""
    root = os.environ.get("LMYARD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lmyard")
    return os.path.join(root, *parts)


def confined(base: str, key: str, what: str = "key") -> str:
    """`base/key`, refusing a key that would land outside `base` (`..` segments, an absolute path).

    Keys come from object listings and configs that others may write: a key such as
    `data/../../x` must not become a file outside the folder meant for it.
    """
    parts = key.replace("\\", "/").split("/")
    if key.startswith(("/", "\\")) or os.path.isabs(key) or ".." in parts:
        raise UserError(
            f"{what} {key!r} would leave its folder {base} (an absolute path or `..` segments); "
            "rename the object or fix the key"
        )
    norm = posixpath.normpath("/".join(parts)) if key else ""
    return os.path.join(base, norm) if norm not in ("", ".") else base
