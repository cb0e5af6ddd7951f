"""The exchange folder of one launch, and the atomic JSON files in it.

A launcher (lmyard.launch) hands a stage its spec and reads back what the stage writes into its exchange folder
(`LMYARD_EXCHANGE_DIR`; in a container a folder inside it, read back through the engine), each file written
atomically (a temp file, then rename, mode 0644). Nothing is parsed from log lines: the log is for people.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

EXCHANGE_ENV = "LMYARD_EXCHANGE_DIR"
SPEC_ENV = "LMYARD_SPEC"  # the spec itself, where no file can be handed over (a container)
M = TypeVar("M", bound=BaseModel)


class Contract(BaseModel):
    """A typed file between processes: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


def write_json(path: str, data: BaseModel | dict | list) -> None:
    """Write JSON atomically (a temp file in the same folder, then rename), readable by other users."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_model(path: str, cls: type[M]) -> M | None:
    """The contract in a file, or None when the file does not exist (yet)."""
    try:
        with open(path) as f:
            return cls.model_validate_json(f.read())
    except FileNotFoundError:
        return None


class Exchange:
    """The paths of one launch's exchange folder (see lmyard.stages)."""

    def __init__(self, folder: str):
        self.folder = folder

    @classmethod
    def from_env(cls) -> Exchange | None:
        folder = os.environ.get(EXCHANGE_ENV)
        return cls(folder) if folder else None

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    @property
    def heartbeats(self) -> str:
        return self.path("heartbeat")

    def write(self, name: str, data: BaseModel | dict) -> None:
        write_json(self.path(name), data)
