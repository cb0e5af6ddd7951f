"""Where lmyard keeps local files, keys that must stay inside their folder, and what a store URI may be.

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


def store_uri_problem(uri: str) -> str | None:
    """What is wrong with a store URI (`store`), as a sentence that starts with it and names the fix; None when
    it is usable. The config refuses such a store when it is read; open_store when it is opened."""
    if uri.startswith("s3://"):
        if not uri.removeprefix("s3://").partition("/")[0]:
            return f"{uri!r} names no bucket: give s3://BUCKET/prefix, e.g. s3://my-bucket/lmyard"
        return None
    if "://" in uri and not uri.startswith("file://"):
        return f"{uri!r} is not a store URI: use a local path, file://..., or s3://bucket/prefix"
    if not uri.removeprefix("file://").strip():
        return f"{uri!r} names no folder: give a local path, file://..., or s3://bucket/prefix"
    return None


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
