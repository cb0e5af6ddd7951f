"""HellaSwag-format examples, read without torch: from a JSONL file (a path or an s3:// URI) or a hub dataset.

Each example is {ctx, endings, label}; lmyard.evaluate.evals scores them with the model, and
lmyard.evaluate.harness hands them to lm-eval's own HellaSwag task (`hellaswag_local`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from lmyard.errors import UserError
from lmyard.store import read_object


def read_hellaswag(source: str, split: str = "validation", limit: int | None = None) -> list[dict]:
    """Examples {ctx, endings, label} from a JSONL file (path or s3:// URI) or a hub dataset."""
    if source.startswith("s3://") or source.endswith((".jsonl", ".json")) or os.path.exists(source):
        rows = _jsonl_rows(source)
    else:
        rows = _hub_rows(source, split)
    out = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        try:
            ex = {"ctx": row["ctx"], "endings": list(row["endings"]), "label": int(row["label"])}
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"eval.hellaswag {source}: example {i} lacks ctx/endings/label ({e})") from None
        if not 0 <= ex["label"] < len(ex["endings"]):
            raise UserError(
                f"eval.hellaswag {source}: example {i} has label {ex['label']} for {len(ex['endings'])} endings"
            )
        out.append(ex)
    if not out:
        raise UserError(f"eval.hellaswag {source} holds no examples")
    return out


def _jsonl_rows(source: str) -> Iterator[dict]:
    if source.startswith("s3://"):
        data = read_object(source).decode()
    else:
        if not os.path.exists(source):
            raise UserError(f"eval.hellaswag {source} does not exist")
        with open(source, encoding="utf-8") as f:
            data = f.read()
    for line in data.splitlines():
        if line.strip():
            yield json.loads(line)


def _hub_rows(name: str, split: str) -> Iterator[dict]:
    import datasets  # e.g. Rowan/hellaswag: ctx, endings, label (a string)

    yield from datasets.load_dataset(name, split=split, streaming=True)
