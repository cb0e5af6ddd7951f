"""The shard tests' corpus: documents as a JSON-lines file."""

from __future__ import annotations

import json


def _corpus(tmp_path, docs):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return src
