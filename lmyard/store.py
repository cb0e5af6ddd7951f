"""The store: one small interface over string URIs.

`open_store` makes a local folder of "path/or/file:///dir" and S3 of "s3://bucket/prefix",
through boto3 (any S3-compatible server through AWS_ENDPOINT_URL;
credentials from boto3's standard chain, never from the config). Keys are
POSIX paths relative to the root, e.g. `shards/<address>/manifest.json`.
Strings, not Paths: a Path mangles `s3://`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from lmyard.errors import UserError
from lmyard.paths import confined, store_uri_problem


class Store(Protocol):
    root: str

    def uri(self, key: str) -> str: ...
    def exists(self, key: str) -> bool: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def upload(self, local_path: str, key: str) -> None: ...
    def download(self, key: str, local_path: str) -> None: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, prefix: str) -> None: ...
    def copy(self, key: str, dest_key: str) -> None: ...
    def size(self, key: str) -> int | None: ...
    def local_path(self, key: str) -> str | None: ...
    def sha256(self, key: str) -> str | None: ...
    def check_writable(self, *keys: str) -> None: ...


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator:
    """A new file in `path`'s folder, renamed over `path` once written (atomic). Its mode follows the
    umask like any open() (0644 by default), not mkstemp's 0600: readers under another uid can read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest existing parent. A folder on the way this user cannot enter is an OSError that
    names it (its filename)."""
    for p in (path, *path.parents):
        try:
            os.stat(p)
            return p
        except FileNotFoundError:
            continue
        except PermissionError as e:
            blocked = next((q for q in p.parents if _stats(q)), Path(p.anchor))
            raise PermissionError(e.errno, f"{e.strerror}: this user cannot enter {blocked}", str(blocked)) from None
    return Path(path.anchor)


def _stats(path: Path) -> bool:
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def _probe(folder: Path) -> None:
    """Create and remove an empty file in `folder` (an OSError when this process cannot)."""
    if not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{folder} is a file")
    probe = folder / f".lmyard-write-probe.{os.getpid()}.{secrets.token_hex(4)}"
    probe.write_bytes(b"")
    probe.unlink()


class LocalStore:
    """A folder. Writes go to a temp file in the same folder, then rename (atomic)."""

    def __init__(self, root: str):
        self.root = str(Path(root.removeprefix("file://")).expanduser().resolve())

    def _path(self, key: str) -> Path:
        return Path(confined(self.root, key, "store key"))

    def check_writable(self, *keys: str) -> None:
        """A UserError now, before hours of work, when this process cannot create files in the folder, or in the
        folders `keys` name under it (`runs/<run>`: a read-only `runs/`), each checked in its nearest existing
        folder, where it would be made. Leaves nothing behind."""
        for folder in (Path(self.root), *(self._path(key) for key in keys)):
            try:
                existing = folder
                existing = _nearest_existing(folder)
                _probe(existing)
            except OSError as e:
                where = f"store {self.root}" + (f": its folder {existing}" if str(existing) != self.root else "")
                raise UserError(
                    f"{where} is not writable ({e.strerror or type(e).__name__}): "
                    "choose a folder this user can write with --set store=PATH, or fix its permissions"
                ) from None

    def uri(self, key: str) -> str:
        return str(self._path(key))

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        with _replacing(self._path(key)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def upload(self, local_path: str, key: str) -> None:
        path = self._path(key)
        if path.exists() and Path(local_path).resolve() == path.resolve():
            return
        with _replacing(path) as f, open(local_path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 22)

    def download(self, key: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), local_path)

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
        )

    def copy(self, key: str, dest_key: str) -> None:
        self.upload(str(self._path(key)), dest_key)

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def delete(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def sha256(self, key: str) -> str | None:
        """Hex SHA-256 of the object's bytes, or None when it does not exist."""
        path = self._path(key)
        if not path.is_file():
            return None
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        return h.hexdigest()


# 64 MiB parts, 8 in parallel: a 100M-token shard (200 MB) goes up as 4 parts at once.
TRANSFER = dict(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)


def s3_client():
    """A boto3 S3 client from the standard chain (AWS_ENDPOINT_URL, AWS_PROFILE, ...).

    Short connect timeouts and few retries: an unreachable endpoint is reported in
    seconds, not after minutes of backoff.
    """
    import boto3
    from botocore.config import Config

    # A fresh session: boto3's default one keeps the credentials it resolved first.
    return boto3.session.Session().client(
        "s3", config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"})
    )


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """Turn S3 failures that only the user can fix into one-line UserErrors naming the fix."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    try:
        yield
    except EndpointConnectionError as e:
        raise UserError(
            f"{what}: cannot reach the S3 endpoint {e.kwargs.get('endpoint_url')}; "
            "check AWS_ENDPOINT_URL and the network"
        ) from None
    except NoCredentialsError:
        raise UserError(
            f"{what}: no S3 credentials found; set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        ) from None
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code"))
        if code in ("NoSuchBucket",):
            raise UserError(f"{what}: the bucket does not exist; create it or fix the URI") from None
        if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise UserError(
                f"{what}: access denied ({code}); check the credentials (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID) and the bucket's policy"
            ) from None
        raise


class S3Store:
    """s3://bucket/prefix through boto3; uploads use its managed multipart transfer.

    Every call is wrapped in `s3_errors`: a missing bucket, denied access or an
    unreachable endpoint is a UserError that names the fix.
    """

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        bucket_prefix = self.root.removeprefix("s3://")
        self.bucket, _, self.prefix = bucket_prefix.partition("/")
        if not self.bucket:
            raise UserError(f"store {store_uri_problem(root)}")
        self.client = s3_client()
        self._bucket_checked = False

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _errors(self, key: str = ""):
        return s3_errors(f"store {self.uri(key) if key else self.root}")

    def check_writable(self, *keys: str) -> None:
        """The bucket exists (a denied write names its fix when it happens: s3_errors)."""
        self._check_bucket()

    def _check_bucket(self) -> None:
        """HEAD on a missing key and on a missing bucket both say 404: tell them apart once."""
        if self._bucket_checked:
            return
        from botocore.exceptions import ClientError

        with self._errors():
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchBucket", "NotFound"):
                    raise UserError(
                        f"store {self.root}: bucket {self.bucket!r} does not exist; create it or fix `store`"
                    ) from None
                raise
        self._bucket_checked = True

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        self._check_bucket()
        with self._errors(key):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))
                return True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

    def read_bytes(self, key: str) -> bytes:
        self._check_bucket()
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def write_bytes(self, key: str, data: bytes) -> None:
        self._check_bucket()
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def upload(self, local_path: str, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        self._check_bucket()
        with self._errors(key):
            self.client.upload_file(local_path, self.bucket, self._key(key), Config=TransferConfig(**TRANSFER))

    def download(self, key: str, local_path: str) -> None:
        from boto3.s3.transfer import TransferConfig

        self._check_bucket()
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{local_path}.{os.getpid()}.part"  # ranks of one node may fetch the same file at once
        with self._errors(key):
            self.client.download_file(self.bucket, self._key(key), tmp, Config=TransferConfig(**TRANSFER))
        os.replace(tmp, local_path)

    def list(self, prefix: str) -> list[str]:
        self._check_bucket()
        strip = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        with self._errors(prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            ):
                keys.extend(obj["Key"].removeprefix(strip) for obj in page.get("Contents", []))
        return sorted(keys)

    def copy(self, key: str, dest_key: str) -> None:
        """A server-side copy (managed: multipart for large objects); nothing passes through this machine."""
        from boto3.s3.transfer import TransferConfig

        self._check_bucket()
        with self._errors(key):
            self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(key)},
                self.bucket,
                self._key(dest_key),
                Config=TransferConfig(**TRANSFER),
            )

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        self._check_bucket()
        with self._errors(key):
            try:
                return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

    def delete(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix)]
        with self._errors(prefix):
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
                )

    def local_path(self, key: str) -> str | None:
        return None

    def sha256(self, key: str) -> str | None:
        """Hex SHA-256 of the object, streamed (4 MiB at a time, nothing on disk); None when missing."""
        if not self.exists(key):
            return None
        h = hashlib.sha256()
        with self._errors(key):
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            for block in body.iter_chunks(1 << 22):
                h.update(block)
        return h.hexdigest()


def open_store(uri: str) -> Store:
    problem = store_uri_problem(uri)
    if problem:
        raise UserError(f"store {problem}")
    return S3Store(uri) if uri.startswith("s3://") else LocalStore(uri)


def read_object(uri: str) -> bytes:
    """The bytes of one object named by its whole URI (`s3://bucket/key`)."""
    root, _, name = uri.rpartition("/")
    return open_store(root).read_bytes(name)
