"""Compiled code travels with the lineage (lmyard.train.compile_cache): a key that does not match, a damaged
record and a foreign one each compile as before, with one line, and the key holds what makes compiled code valid
and names no lineage (an attempt on an empty node and another lineage loading it from the run's store:
tests/integration/test_compile_cache_integration.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import tiny_overrides

from lmyard.layout import compile_cache
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
    part = {"name": "w-0.bin", "sha256": sha or hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    meta = {"fields": fields or cache.fields, "parts": [part]}
    cache.run.store.write_bytes(compile_cache(cache.key, "w-0.bin"), blob)
    cache.run.store.write_bytes(compile_cache(cache.key, "json"), json.dumps(meta).encode())


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
    other = key_fields(load_recipe("smoke", tiny_overrides(tmp_path, run_name="another-lineage")), 1, CPU)
    assert digest(other) == digest(base)  # no lineage in the key: the store's compiled code serves all of them
