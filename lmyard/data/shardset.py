"""A complete shard set as it travels between processes: where it lives and what its manifest says.

lmyard.data.shards has the format and writes the manifest; lmyard.data.sharding makes the set. This module is
torch- and numpy-free, so the flow's process and the stage specs (lmyard.stages) hold shard sets cheaply.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ShardSet(BaseModel):
    """A complete shard set: its content address, its store URI and its manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    address: str
    uri: str
    manifest: dict[str, Any]

    def files(self, split: str) -> list[dict]:
        return [s for s in self.manifest["shards"] if s["split"] == split]

    def tokens(self, split: str) -> int:
        return sum(s["tokens"] for s in self.files(split))

    @property
    def n_vocab(self) -> int:
        return int(self.manifest["tokenizer"]["n_vocab"])

    @property
    def separators(self) -> tuple[int | None, int | None]:
        """(id written before each document, id written after it), as the manifest's tokenizer records them
        (lmyard.data.tokenizer.identity): its bos/eos where set, else tiktoken's <|endoftext|> before each."""
        t = self.manifest["tokenizer"]
        if "bos" in t or "eos" in t:
            return t.get("bos"), t.get("eos")
        return t.get("eot"), None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, d: dict) -> ShardSet:
        return cls.model_validate(d)
