"""A damaged newest checkpoint: the run falls back to the one before, moves the damaged one aside (never
rewrites it in place), and its attempt records what it really resumed from."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.layout import RunLayout
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage

pytestmark = pytest.mark.slow
ONE_RANK = {"launch.nproc_per_node": 1}  # a fallback reads and writes the same files whatever the ranks


def test_fallback_moves_the_damaged_checkpoint_aside_and_the_attempt_names_what_was_loaded(
    prefect_api_url, tmp_path, monkeypatch
):
    from prefect import flow

    from tasks.train import train

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    overrides = tiny_overrides(
        tmp_path,
        steps=8,
        **{
            "run_name": "fallback",
            "checkpoint.interval": 4,
            "checkpoint.keep_last": 5,
            "eval.interval": 100,
            **ONE_RANK,
        },
    )
    cfg = load_recipe("smoke", overrides)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address=shards.address, code_version="test")

    @flow(name="train-only")
    def train_only(config):
        return train.with_options(retries=0)(config, shards, lineage)

    assert train_only(cfg).step == 8 and complete_steps(Run("fallback", store)) == [4, 8]
    damaged = store.local_path(f"{RunLayout('fallback').step(8)}/model.pt")
    data = bytearray(open(damaged, "rb").read())
    data[-20] ^= 0xFF
    open(damaged, "wb").write(bytes(data))

    result = train_only(load_recipe("smoke", [*overrides, "train.max_steps=12"]))
    assert result.step == 12 and result.start_step == 4
    assert result.resumed_from == store.uri(RunLayout("fallback").step(4))
    attempt = lineage.attempts()[-1]
    assert attempt["resumed_from"] == store.uri(RunLayout("fallback").step(4)) and attempt["start_step"] == "4"
    # the damaged files, byte for byte, moved aside; step 8 trained again into a fresh folder
    (aside,) = [k for k in store.list("runs/fallback/damaged") if k.endswith("/model.pt")]
    assert store.read_bytes(aside) == bytes(data)
    assert complete_steps(Run("fallback", store)) == [4, 8, 12]
    assert store.read_bytes(f"{RunLayout('fallback').step(8)}/model.pt") != bytes(data)


def test_a_step_trained_again_after_a_fallback_is_evaluated_again_and_its_damaged_result_marked(
    prefect_api_url, tmp_path, monkeypatch
):
    """The rerun falls back from the damaged step 8 to step 4 and trains step 8 again; that new
    checkpoint is evaluated (once), and the earlier result of step 8 is marked as a damaged checkpoint's."""
    from mlflow.tracking import MlflowClient

    from flows.pretrain import pretrain
    from lmyard.checkpoint.catalog import read_manifest
    from lmyard.evaluate.history import evaluated_checkpoints

    monkeypatch.setenv("LMYARD_CACHE", str(tmp_path / "cache"))
    run = "refallback"
    overrides = tiny_overrides(
        tmp_path,
        steps=8,
        **{"run_name": run, "checkpoint.interval": 4, "checkpoint.keep_last": 5, "eval.interval": 100, **ONE_RANK},
    )
    cfg = load_recipe("smoke", overrides)
    first = pretrain(config=cfg)
    store = open_store(cfg.store)
    damaged = store.local_path(f"{RunLayout(run).step(8)}/model.pt")
    data = bytearray(open(damaged, "rb").read())
    data[-20] ^= 0xFF
    open(damaged, "wb").write(bytes(data))

    second = pretrain(config=load_recipe("smoke", [*overrides, "train.max_steps=12", "eval.poll_s=0.5"]))
    assert second.mlflow_run_id == first.mlflow_run_id and second.steps == 12
    assert not second.failed_evaluations and store.list(f"runs/{run}/damaged")

    client = MlflowClient(cfg.tracking.uri)
    # step 8 evaluated twice in all: the damaged checkpoint (first run), the one trained again (second run)
    evaluated = client.get_metric_history(first.mlflow_run_id, "loss/eval")
    assert sorted(m.step for m in evaluated) == [4, 8, 8, 12]
    tags = client.get_run(first.mlflow_run_id).data.tags
    assert not [k for k in tags if k.startswith("lmyard.evaluated")]  # bookkeeping is no run tag
    lineage = Lineage.find(cfg.tracking.uri, Run(run, store))
    assert lineage is not None and evaluated_checkpoints(lineage)[8] == repr(
        read_manifest(Run(run, store), 8).committed
    )
    assert f"runs/{run}/damaged/step_00000008-" in tags["lmyard.eval_of_damaged.step_00000008"]
    models = client.search_logged_models([client.get_run(first.mlflow_run_id).info.experiment_id])
    at_8 = sorted(
        (str(m.status), m.tags.get("lmyard.checkpoint_damaged")) for m in models if m.tags.get("lmyard.step") == "8"
    )
    assert at_8[1] == ("READY", None) and at_8[0][0] == "FAILED" and "found damaged" in at_8[0][1]
    # a third run of the finished lineage evaluates nothing again
    third = pretrain(config=load_recipe("smoke", [*overrides, "train.max_steps=12"]))
    assert third.steps == 12
    assert sorted(m.step for m in client.get_metric_history(first.mlflow_run_id, "loss/eval")) == [4, 8, 8, 12]
    # and records each checkpoint once: step 8 twice (two checkpoints), the final step 12 not again
    assert sorted(m.step for m in client.get_metric_history(first.mlflow_run_id, "system/checkpoint/bytes")) == [
        4,
        8,
        8,
        12,
    ]
