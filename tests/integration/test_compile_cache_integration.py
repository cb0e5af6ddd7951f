"""Compiled code travels with the lineage (lmyard.train.compile_cache): an attempt on an empty node, and another
lineage of the same model, load what the first attempt compiled from the run's store and compile nothing, by
torch's own cache counters; a damaged record is ignored and compiles as before, and the losses stay (the key and the records:
tests/unit/train/test_compile_cache.py)."""

from __future__ import annotations

import shutil

import pytest
from conftest import tiny_overrides

from lmyard.data.sharding import tokenize_and_shard
from lmyard.launch.local_job import run_local
from lmyard.layout import COMPILE
from lmyard.recipes import load_recipe


def _attempt(tmp_path, store, node: str, steps: int, monkeypatch, **extra):
    """One launch of the train stage on a node with empty caches (its own LMYARD_CACHE and inductor cache)."""
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / node))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / node / "inductor"))
    # one rank: what travels is the same for every rank, and each of the four attempts compiles on the CPU
    overrides = {"store": store, "train.compile": "true", "eval.interval": 100, "checkpoint.interval": 2, **extra}
    overrides["launch.nproc_per_node"] = 1
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=steps, **overrides))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    lines: list[str] = []
    return run_local(cfg, spec, on_line=lines.append), lines


@pytest.mark.integration
@pytest.mark.slow
def test_an_attempt_on_an_empty_node_and_another_lineage_load_compiled_code_from_the_store_a_damaged_one_compiles(
    tmp_path, monkeypatch
):
    first, _ = _attempt(tmp_path, str(tmp_path / "store"), "node1", 2, monkeypatch)
    assert first.compile_cache and first.compile_cache.found == "none" and first.compile_cache.fxgraph_misses > 0
    shutil.copytree(tmp_path / "store", tmp_path / "store-damaged")

    loaded, lines = _attempt(tmp_path, str(tmp_path / "store"), "node2", 4, monkeypatch)
    c = loaded.compile_cache
    assert c is not None and c.found == "loaded" and c.loaded > 0, lines
    # torch's own counters in the rank: every graph came from the loaded cache, none was compiled
    assert c.fxgraph_hits > 0 and c.fxgraph_misses == 0 and c.autograd_misses == 0, c

    # another lineage of the same model, from step 0 on a third empty node: the store's compiled code, none compiled,
    # and the losses of the first attempt's two steps, which compiled it
    other, lines = _attempt(tmp_path, str(tmp_path / "store"), "node4", 2, monkeypatch, run_name="another-lineage")
    o = other.compile_cache
    assert o is not None and o.found == "loaded" and o.fxgraph_misses == 0 and o.autograd_misses == 0, lines
    assert (other.start_step, other.step) == (0, 2) and other.train_loss == pytest.approx(first.train_loss, abs=1e-6)

    # a damaged record, on the first node: nothing is loaded from the store, and the graphs come from that node's
    # own inductor cache, as they do without a store's (an empty node's CPU compile is the first attempt's, above)
    for path in (tmp_path / "store-damaged" / COMPILE).glob("*.bin"):
        path.write_bytes(path.read_bytes()[:-7] + b"damaged")
    damaged, lines = _attempt(tmp_path, str(tmp_path / "store-damaged"), "node1", 4, monkeypatch)
    d = damaged.compile_cache
    assert d is not None and d.found == "damaged" and d.loaded == 0 and d.fxgraph_hits > 0, d
    assert len([ln for ln in lines if ln.startswith("compile cache:") and "ignored" in ln]) == 1, lines
    assert (damaged.step, damaged.start_step) == (loaded.step, loaded.start_step) == (4, 2)
    assert damaged.train_loss == pytest.approx(loaded.train_loss, abs=1e-6)
    assert damaged.val_loss == pytest.approx(loaded.val_loss, abs=1e-6)
