"""Where lmyard keeps local files, keys that must stay inside their folder, what a store URI may be, and the
sha256 of a local file.

Every node-local cache (shards read by the trainer, source files fetched from
S3, checkpoints being loaded, checkpoints staged for upload, image builds)
lives under one root: `LMYARD_CACHE`, default `~/.cache/lmyard`.

Design notes: docs/tracking.md, `lmyard/paths.py`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import shutil

from lmyard.errors import NoSpace, UserError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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


def _disk_full_error(exc: BaseException | None, seen: set[int]) -> OSError | NoSpace | None:
    """The ENOSPC/EDQUOT error (or a NoSpace) in `exc`, its causes, or the per-rank failures DCP gathers."""
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if isinstance(exc, NoSpace) or isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return exc
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException: rank -> (e, tb)
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
    for candidate in (exc.__cause__, exc.__context__, *inner):
        if isinstance(candidate, BaseException) and (found := _disk_full_error(candidate, seen)):
            return found
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def free_space(folder: str) -> str:
    """ "N MiB free" on the disk of `folder` (or of its nearest existing parent)."""
    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return f"{_mib(shutil.disk_usage(probe or '/').free)} free"
    except OSError:
        return "free space unknown"


def no_space(exc: BaseException, folder: str | None = None, needed: int | None = None) -> NoSpace | None:
    """A NoSpace naming the folder, its free space and the fix when `exc` comes from a full disk (or quota), else
    None. `folder`: where the write went (default: the file the error names, else the cache root); `needed`:
    the bytes the write wanted, when known."""
    found = _disk_full_error(exc, set())
    if found is None or isinstance(found, NoSpace):
        return found
    where = folder or (os.path.dirname(str(found.filename)) if found.filename else cache_root())
    free = free_space(where)
    what = "quota exceeded" if found.errno == errno.EDQUOT else "no space left"
    wanted = f", {_mib(needed)} needed" if needed else ""
    return NoSpace(
        f"{what} in {where} ({free}{wanted}): free space there or point LMYARD_CACHE at a bigger disk, then rerun "
        "(it resumes from the last committed checkpoint)"
    )


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """The hex sha256 of a local file, read in `chunk`-byte blocks (a shard's, a checkpoint file's)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
