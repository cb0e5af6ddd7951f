"""Compiled code travels with the lineage (lmyard.train.compile_cache): an attempt on an empty node loads what the
first attempt compiled from the run's store and compiles nothing, by torch's own cache counters; a key that does
not match, a damaged record and a foreign one each compile as before, with one line, and the losses stay."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from conftest import tiny_overrides

from lmyard.data.sharding import tokenize_and_shard
from lmyard.launch.local_job import run_local
from lmyard.layout import RunLayout
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.train.compile_cache import CompileCache, digest, key_fields

CPU = torch.device("cpu")


def _cache(tmp_path, world: int = 1, **extra) -> CompileCache:
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, **{"train.compile": "true", **extra}))
    run = Run(cfg.run_name, open_store(cfg.store), str(tmp_path / "cache"))
    return CompileCache.of(cfg, run, world, CPU, rank=0)


def _write(cache: CompileCache, blob: bytes, fields: dict | None = None, sha: str | None = None) -> None:
    """A record and blob under `cache`'s key, as a save writes them (fields, sha256 overridable)."""
    part = {"sha256": sha or hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    meta = {"fields": fields or cache.fields, "parts": [part]}
    cache.run.store.write_bytes(cache.run.layout.compile_cache(cache.key, "0.bin"), blob)
    cache.run.store.write_bytes(cache.run.layout.compile_cache(cache.key, "json"), json.dumps(meta).encode())


def test_a_key_with_no_artifacts_compiles_and_names_the_fields_that_differ_once(tmp_path, capsys):
    two_ranks = _cache(tmp_path, world=2)
    _write(two_ranks, b"artifacts of a 2-rank job")
    one_rank = _cache(tmp_path, world=1)
    assert one_rank.key != two_ranks.key
    assert one_rank.load() == 0 and one_rank.found == "mismatch"
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("compile cache: none for this job's key") and "world_size" in line, line
    assert "model" not in line.split("(")[1]  # only what differs is named


@pytest.mark.parametrize(
    "damage",
    ["flipped byte", "foreign record", "not torch's format"],
)
def test_a_damaged_or_foreign_cache_is_ignored_with_one_line(tmp_path, capsys, damage):
    cache = _cache(tmp_path)
    if damage == "flipped byte":
        _write(cache, b"\x00garbage", sha=hashlib.sha256(b"garbage").hexdigest())
    elif damage == "foreign record":
        other = {**cache.fields, "arch": "sm_90"}
        _write(cache, b"another machine's", fields=other)
        assert digest(other) != cache.key
    else:
        _write(cache, b"a whole blob, its sha256 right, that torch cannot read")
    assert cache.load() == 0 and cache.found == "damaged"
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("compile cache: ") and "ignored" in lines[0], lines


def test_the_key_holds_what_makes_compiled_code_valid_and_not_the_schedule(tmp_path):
    base = key_fields(load_recipe("smoke", tiny_overrides(tmp_path)), 1, CPU)
    assert base["arch"] == "cpu" and base["torch"] == torch.__version__ and base["world_size"] == 1
    longer = key_fields(load_recipe("smoke", tiny_overrides(tmp_path, steps=60, **{"train.lr": 0.01})), 1, CPU)
    wider = key_fields(load_recipe("smoke", tiny_overrides(tmp_path, **{"model.n_embd": 128})), 1, CPU)
    assert digest(longer) == digest(base) and digest(wider) != digest(base)


def _attempt(tmp_path, store, node: str, steps: int, monkeypatch, **extra):
    """One launch of the train stage on a node with empty caches (its own LMYARD_CACHE and inductor cache)."""
    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / node))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / node / "inductor"))
    overrides = {"store": store, "train.compile": "true", "eval.interval": 100, "checkpoint.interval": 2, **extra}
    cfg = load_recipe("smoke", tiny_overrides(tmp_path, steps=steps, **overrides))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    lines: list[str] = []
    return run_local(cfg, spec, on_line=lines.append), lines


@pytest.mark.integration
@pytest.mark.slow
def test_an_attempt_on_an_empty_node_loads_compiled_code_from_the_store_and_a_damaged_one_compiles(
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

    blob = RunLayout(load_recipe("smoke", []).run_name).compile_root
    for path in (tmp_path / "store-damaged" / blob).glob("*.bin"):
        path.write_bytes(path.read_bytes()[:-7] + b"damaged")
    damaged, lines = _attempt(tmp_path, str(tmp_path / "store-damaged"), "node3", 4, monkeypatch)
    d = damaged.compile_cache
    assert d is not None and d.found == "damaged" and d.fxgraph_misses > 0
    assert len([ln for ln in lines if ln.startswith("compile cache:") and "ignored" in ln]) == 1, lines
    assert (damaged.step, damaged.start_step) == (loaded.step, loaded.start_step) == (4, 2)
    assert damaged.train_loss == pytest.approx(loaded.train_loss, abs=1e-6)
    assert damaged.val_loss == pytest.approx(loaded.val_loss, abs=1e-6)
