"""Which checkpoint of each step the lineage's MLflow run has recorded and evaluated: the JSON artifact
lmyard/checkpoints.json (schema.BOOKKEEPING), not run tags or metrics, so the run page shows none of it.

A checkpoint is its step and its manifest's commit time. `{"<step>": {"recorded": [commit times],
"evaluated": "<commit id>"}}`: a step trained again after a fallback holds another checkpoint, recorded and
evaluated again. One writer per lineage (the lease) reads, updates and writes it back.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from lmyard.tracking import schema


def read(lineage) -> dict[int, dict[str, Any]]:
    """step -> its entry; {} when nothing was recorded yet."""
    names = {
        f.path for f in lineage.client.list_artifacts(lineage.ref.mlflow_run_id, os.path.dirname(schema.BOOKKEEPING))
    }
    if schema.BOOKKEEPING not in names:
        return {}
    with tempfile.TemporaryDirectory(prefix="lmyard-bookkeeping-") as tmp:
        path = lineage.client.download_artifacts(lineage.ref.mlflow_run_id, schema.BOOKKEEPING, tmp)
        with open(path) as f:
            return {int(step): entry for step, entry in json.load(f).items()}


def update(lineage, step: int, **fields: Any) -> None:
    """Merge `fields` into the entry of `step` (`recorded`: a commit time appended to its list)."""
    book = read(lineage)
    entry = book.setdefault(step, {})
    if "recorded" in fields:
        entry["recorded"] = [*entry.get("recorded", []), fields.pop("recorded")]
    entry.update(fields)
    lineage.log_dict({str(s): e for s, e in sorted(book.items())}, schema.BOOKKEEPING)


def recorded(lineage, step: int) -> list[float]:
    """The commit times of the checkpoints recorded at `step`."""
    return list(read(lineage).get(step, {}).get("recorded", []))


def evaluated(lineage, steps: list[int]) -> dict[int, str | None]:
    """step -> the commit id of the checkpoint evaluated at that step (None: not in the bookkeeping), for the
    evaluated `steps`."""
    book = read(lineage)
    return {step: book.get(step, {}).get("evaluated") for step in steps}
