"""The trainer under train.parallel=fsdp (FSDP2, sharded checkpoints) on 2 CPU ranks (gloo): it matches ddp,
resumes exactly on 2 ranks and reshards to 1, and checkpoints move between ddp and fsdp both ways."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import read_manifest, read_state
from lmyard.checkpoint.resume import load_step
from lmyard.data.sharding import tokenize_and_shard
from lmyard.launch.local_job import run_local
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    cfg = load_recipe("smoke", tiny_overrides(tmp))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    return tmp, shards


def _run(env, run_name, parallel, *, nproc=2, faults="", **extra):
    tmp, shards = env
    values = {
        "run_name": run_name,
        "model.preset": "llama-tiny",
        "train.parallel": parallel,
        "launch.nproc_per_node": nproc,
        "checkpoint.interval": 4,
        "eval.interval": 4,
        **extra,
    }
    cfg = load_recipe("smoke", tiny_overrides(tmp, steps=8, **values))
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict()}
    os.environ["LMYARD_CACHE"] = str(tmp / "cache")
    os.environ["LMYARD_FAULTS"] = faults
    try:
        return run_local(cfg, spec, on_line=lambda s: None)
    except Exception as e:
        return e
    finally:
        os.environ.pop("LMYARD_FAULTS")


def _weights(env, run_name, step=8):
    tmp, _ = env
    return load_step(Run(run_name, open_store(str(tmp / "store"))), step, str(tmp / "load")).model


@pytest.fixture(scope="module")
def fsdp_straight(env):
    result = _run(env, "fsdp-straight", "fsdp")
    assert result.step == 8, result
    return _weights(env, "fsdp-straight")


def test_fsdp_training_matches_ddp_training(env, fsdp_straight):
    assert _run(env, "ddp-straight", "ddp").step == 8
    ddp = _weights(env, "ddp-straight")
    assert sorted(ddp) == sorted(fsdp_straight)
    for name in ddp:  # same data, same updates: equal up to the order of float sums in the reductions
        torch.testing.assert_close(fsdp_straight[name], ddp[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_two_rank_fsdp_checkpoint_resumes_exactly_on_two_ranks(env, fsdp_straight):
    crashed = _run(env, "fsdp-crashed", "fsdp", faults="crash@6")
    assert isinstance(crashed, Exception)
    result = _run(env, "fsdp-crashed", "fsdp")
    assert result.start_step == 4 and result.step == 8
    resumed = _weights(env, "fsdp-crashed")
    for name in fsdp_straight:  # bit for bit: same shards, same reductions, same RNG states
        assert torch.equal(resumed[name], fsdp_straight[name]), name


def test_a_two_rank_fsdp_checkpoint_reshards_onto_one_rank_with_the_same_token_order(env, fsdp_straight):
    assert isinstance(_run(env, "fsdp-to-one", "fsdp", faults="crash@6"), Exception)
    result = _run(env, "fsdp-to-one", "fsdp", nproc=1)
    assert result.start_step == 4 and result.step == 8
    tmp, _ = env
    store = open_store(str(tmp / "store"))
    assert read_state(Run("fsdp-to-one", store), 8).cursor == read_state(Run("fsdp-straight", store), 8).cursor
    one = _weights(env, "fsdp-to-one")
    for name in fsdp_straight:  # one rank reads both ranks' sequences: the same updates up to summation order
        torch.testing.assert_close(one[name], fsdp_straight[name], rtol=2e-4, atol=2e-5, msg=name)


def test_checkpoints_move_from_ddp_to_fsdp_and_back(env, fsdp_straight):
    assert isinstance(_run(env, "ddp-then-fsdp", "ddp", faults="crash@6"), Exception)
    result = _run(env, "ddp-then-fsdp", "fsdp")
    assert result.start_step == 4 and result.step == 8
    assert isinstance(_run(env, "fsdp-then-ddp", "fsdp", faults="crash@6"), Exception)
    result = _run(env, "fsdp-then-ddp", "ddp")
    assert result.start_step == 4 and result.step == 8
    for run_name in ("ddp-then-fsdp", "fsdp-then-ddp"):
        moved = _weights(env, run_name)
        for name in fsdp_straight:
            torch.testing.assert_close(moved[name], fsdp_straight[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_guard_rolls_back_a_sharded_run(env):
    result = _run(env, "fsdp-rollback", "fsdp", faults="nan_loss@6", **{"train.guard.policy": "rollback"})
    assert result.step == 8 and result.rollbacks == 1


def test_the_pretrain_flow_trains_a_sharded_llama_and_evaluates_every_sharded_checkpoint(
    env, prefect_api_url, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from flows.pretrain import pretrain

    tmp, _ = env
    monkeypatch.setenv("LMYARD_CACHE", str(tmp / "cache"))
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp,
            steps=8,
            **{
                "run_name": "fsdp-flow",
                "model.preset": "llama-tiny",
                "train.parallel": "fsdp",
                "checkpoint.interval": 4,
                "eval.interval": 4,
                "tracking.uri": f"sqlite:///{tmp / 'fsdp-mlflow.db'}",
            },
        ),
    )
    summary = pretrain(config=cfg)
    assert summary.steps == 8
    store = open_store(cfg.store)
    assert read_manifest(Run("fsdp-flow", store), 8).format == "dcp"
    client = MlflowClient(cfg.tracking.uri)
    val = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "loss/val")}
    evaluated = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "loss/eval")}
    assert sorted(evaluated) == [4, 8]  # the evaluator reads each sharded checkpoint whole, on one device
    assert evaluated == {s: pytest.approx(val[s], rel=1e-5) for s in (4, 8)}


def test_bf16_shards_resume_exactly_with_their_float32_masters(env):
    """train.fsdp_param_dtype=bfloat16 on 2 ranks: a run crashed at step 6 and resumed from its step-4
    checkpoint ends with the bf16 weights and the optimizer's float32 masters and moments of the run that did
    not stop, bit for bit."""
    bf16 = {"train.fsdp_param_dtype": "bfloat16"}
    assert _run(env, "bf16-straight", "fsdp", **bf16).step == 8
    assert isinstance(_run(env, "bf16-crashed", "fsdp", faults="crash@6", **bf16), Exception)
    result = _run(env, "bf16-crashed", "fsdp", **bf16)
    assert result.start_step == 4 and result.step == 8
    tmp, _ = env
    store = open_store(str(tmp / "store"))
    straight, resumed = (load_step(Run(run, store), 8, str(tmp / "load")) for run in ("bf16-straight", "bf16-crashed"))
    for name, weight in straight.model.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(resumed.model[name], weight), name
    assert len(straight.optim["state"]) == len(straight.model)
    for i, state in straight.optim["state"].items():
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        for key, value in state.items():
            assert torch.equal(resumed.optim["state"][i][key], value), (i, key)


def test_a_float32_shards_checkpoint_resumed_with_bf16_shards_is_refused_naming_the_fix(env, fsdp_straight):
    """Its optimizer state has no float32 master weights to resume bf16 shards with: one line, before any
    tensor is read, that names the setting to resume it with."""
    result = _run(env, "fsdp-straight", "fsdp", **{"train.fsdp_param_dtype": "bfloat16"})
    assert isinstance(result, Exception)
    assert "was saved with float32 shards" in str(result) and "train.fsdp_param_dtype=float32" in str(result)
