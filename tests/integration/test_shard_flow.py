"""The shard flow on a real Prefect server: what a user watches while it runs."""

from __future__ import annotations

import json

import pytest

from lmyard.data import sharding, token_stream
from lmyard.recipes import load_recipe

pytestmark = pytest.mark.slow


def test_shard_flow_publishes_a_progress_artifact_that_ends_at_100(prefect_api_url, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.shard import shard

    monkeypatch.setattr(sharding, "REPORT_EVERY_S", 0.0)
    monkeypatch.setattr(token_stream, "BATCH_CHARS", 4000)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(60)))
    cfg = load_recipe(
        "smoke", [f"store={tmp_path / 'store'}", f"data.source={src}", "run_name=Progress.Test", "data.num_proc=1"]
    )
    result = shard(config=cfg)

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["progress-test-shard-progress"]))
        )
    assert len(artifacts) == 1 and artifacts[0].type == "progress"
    assert float(artifacts[0].data) == 100.0
    assert "60 documents" in artifacts[0].description and "tokens/s" in artifacts[0].description
    assert result.manifest["documents"] == 60
