"""The store: one small interface over string URIs.

`open_store("path/or/file:///dir")` is a local folder; `open_store("s3://bucket/prefix")`
is S3 through boto3 (any S3-compatible server through AWS_ENDPOINT_URL;
credentials from boto3's standard chain, never from the config). Keys are
POSIX paths relative to the root, e.g. `shards/<address>/manifest.json`.
Strings, not Paths: a Path mangles `s3://`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from lmyard.errors import UserError


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
    def local_path(self, key: str) -> str | None: ...


class LocalStore:
    """A folder. Writes go to a temp file in the same folder, then rename (atomic)."""

    def __init__(self, root: str):
        self.root = str(Path(root.removeprefix("file://")).expanduser().resolve())

    def _path(self, key: str) -> Path:
        return Path(self.root, key)

    def uri(self, key: str) -> str:
        return str(self._path(key))

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def upload(self, local_path: str, key: str) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if Path(local_path).resolve() == path.resolve():
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, path)

    def download(self, key: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), local_path)

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def delete(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))


class S3Store:
    """s3://bucket/prefix through boto3; uploads use its managed multipart transfer."""

    def __init__(self, root: str):
        import boto3

        self.root = root.rstrip("/")
        bucket_prefix = self.root.removeprefix("s3://")
        self.bucket, _, self.prefix = bucket_prefix.partition("/")
        if not self.bucket:
            raise UserError(f"store {root!r}: an S3 store needs a bucket, e.g. s3://my-bucket/lmyard")
        self.client = boto3.client("s3")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def read_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def upload(self, local_path: str, key: str) -> None:
        self.client.upload_file(local_path, self.bucket, self._key(key))

    def download(self, key: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{local_path}.{os.getpid()}.part"  # ranks of one node may fetch the same file at once
        self.client.download_file(self.bucket, self._key(key), tmp)
        os.replace(tmp, local_path)

    def list(self, prefix: str) -> list[str]:
        strip = f"{self.prefix}/" if self.prefix else ""
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)):
            keys.extend(obj["Key"].removeprefix(strip) for obj in page.get("Contents", []))
        return sorted(keys)

    def delete(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def local_path(self, key: str) -> str | None:
        return None


def open_store(uri: str) -> Store:
    if uri.startswith("s3://"):
        return S3Store(uri)
    if "://" in uri and not uri.startswith("file://"):
        raise UserError(f"store {uri!r}: use a local path, file://..., or s3://bucket/prefix")
    return LocalStore(uri)


def fetch_to_cache(store: Store, key: str, cache_dir: str) -> str:
    """A local path for `key`: the file itself for a local store, else a cached download."""
    direct = store.local_path(key)
    if direct is not None:
        return direct
    dest = os.path.join(cache_dir, key)
    if not os.path.exists(dest):
        store.download(key, dest)
    return dest
