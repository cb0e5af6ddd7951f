"""A damaged newest checkpoint: the run falls back to the one before, moves the damaged one aside (never
rewrites it in place), and its attempt records what it really resumed from."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import complete_steps, step_prefix
from lmyard.data.sharding import tokenize_and_shard
from lmyard.recipes import load_recipe
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage

pytestmark = pytest.mark.slow


def test_fallback_moves_the_damaged_checkpoint_aside_and_the_attempt_names_what_was_loaded(
    prefect_api_url, tmp_path, monkeypatch
):
    from prefect import flow

    from tasks.train import train

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    overrides = tiny_overrides(
        tmp_path,
        steps=8,
        **{"run_name": "fallback", "checkpoint.interval": 4, "checkpoint.keep_last": 5, "eval.interval": 100},
    )
    cfg = load_recipe("smoke", overrides)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, store, shard_address=shards.address, code_version="test")

    @flow(name="train-only")
    def train_only(config):
        return train.with_options(retries=0)(config, shards, lineage)

    assert train_only(cfg).step == 8 and complete_steps(store, "fallback") == [4, 8]
    damaged = store.local_path(f"{step_prefix('fallback', 8)}/model.pt")
    data = bytearray(open(damaged, "rb").read())
    data[-20] ^= 0xFF
    open(damaged, "wb").write(bytes(data))

    result = train_only(load_recipe("smoke", [*overrides, "train.max_steps=12"]))
    assert result.step == 12 and result.start_step == 4
    assert result.resumed_from == store.uri(step_prefix("fallback", 4))
    attempt = lineage.attempts()[-1]
    assert attempt["resumed_from"] == store.uri(step_prefix("fallback", 4)) and attempt["start_step"] == "4"
    # the damaged files, byte for byte, moved aside; step 8 trained again into a fresh folder
    (aside,) = [k for k in store.list("runs/fallback/damaged") if k.endswith("/model.pt")]
    assert store.read_bytes(aside) == bytes(data)
    assert complete_steps(store, "fallback") == [4, 8, 12]
    assert store.read_bytes(f"{step_prefix('fallback', 8)}/model.pt") != bytes(data)
