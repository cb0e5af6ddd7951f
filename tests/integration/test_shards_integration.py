"""The tokenize-and-shard stage on local files: the same inputs reuse the shard set, a changed input moves it (the
shard format and the stage: tests/unit/data/test_shards.py)."""

from __future__ import annotations

import pytest
from shards_helpers import _corpus

from lmyard.data.sharding import tokenize_and_shard
from lmyard.recipes import load_recipe


@pytest.mark.integration
def test_same_inputs_reuse_the_shard_set_and_changed_input_moves_it(tmp_path):
    src = _corpus(tmp_path, [f"doc {i}" for i in range(20)])
    overrides = [f"store={tmp_path / 'store'}", f"data.source={src}"]
    first, reused1 = tokenize_and_shard(load_recipe("smoke", overrides), log=lambda s: None)
    second, reused2 = tokenize_and_shard(load_recipe("smoke", overrides), log=lambda s: None)
    assert (reused1, reused2) == (False, True) and first.address == second.address
    _corpus(tmp_path, [f"doc {i}" for i in range(21)])
    third, reused3 = tokenize_and_shard(load_recipe("smoke", overrides), log=lambda s: None)
    assert not reused3 and third.address != first.address
