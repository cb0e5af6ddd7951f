"""The trainer: exact resume, world-size changes, the divergence guard, gradient accumulation."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import tiny_overrides

from lmyard.checkpoint.catalog import complete_steps
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import Diverged, Preempted, UserError
from lmyard.launch.local_job import run_local
from lmyard.models.gpt2.model import GPT, GPTConfig
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.train.trainer import StepParts, train_step


@pytest.fixture(scope="module")
def shard_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    cfg = load_recipe("smoke", tiny_overrides(tmp))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    return tmp, shards


def _run(shard_env, run_name, *, nproc=2, steps=12, faults="", expect_fail=False, on_line=None, **extra):
    tmp, shards = shard_env
    values = {
        "run_name": run_name,
        "launch.nproc_per_node": nproc,
        "train.batch_tokens": 1024,
        "checkpoint.interval": 4,
        "eval.interval": 100,
        **extra,
    }
    cfg = load_recipe("smoke", tiny_overrides(tmp, steps=steps, **values))
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    env_before = os.environ.get("LMYARD_FAULTS")
    os.environ["LMYARD_FAULTS"] = faults
    os.environ["LMYARD_CACHE"] = str(tmp / "cache")
    lines: list[str] = []
    try:
        if expect_fail:
            with pytest.raises(Exception) as info:
                run_local(cfg, spec, on_line=on_line or lines.append)
            return info.value, lines
        return run_local(cfg, spec, on_line=lines.append), lines
    finally:
        os.environ.pop("LMYARD_FAULTS") if env_before is None else os.environ.update(LMYARD_FAULTS=env_before)


def _state(shard_env, run_name, step):
    tmp, _ = shard_env
    d = tmp / "store" / "runs" / run_name / "checkpoints" / f"step_{step:08d}"
    load = lambda name: torch.load(d / name, weights_only=True)
    return load("model.pt"), load("optim.pt")


def _whole_checkpoint(shard_env, run_name, step):
    """Every file of a checkpoint: tensors of model, optimizer and every rank's RNG (Python's, numpy's, torch's),
    and state.json less the run's name."""
    tmp, _ = shard_env
    d = tmp / "store" / "runs" / run_name / "checkpoints" / f"step_{step:08d}"
    state = json.loads((d / "state.json").read_text())
    state["config"].pop("run_name")
    return {name: torch.load(d / name, weights_only=True) for name in ("model.pt", "optim.pt", "rng.pt")}, state


def _assert_identical(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), path
        for k in a:
            _assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def straight(shard_env):
    """An uninterrupted run of 12 steps on 2 ranks: what the interrupted runs must reproduce."""
    _run(shard_env, "straight")
    return "straight"


@pytest.mark.integration
def test_two_fresh_runs_of_one_config_write_identical_checkpoints_every_rng_state_included(shard_env, straight):
    _run(shard_env, "straight-again")
    for step in (4, 12):
        _assert_identical(
            _whole_checkpoint(shard_env, "straight", step), _whole_checkpoint(shard_env, "straight-again", step)
        )


@pytest.mark.integration
def test_resume_after_a_crash_reproduces_the_uninterrupted_run_bit_for_bit(shard_env, straight):
    err, lines = _run(shard_env, "crashed", faults="crash@10", expect_fail=True)
    assert "injected crash after step 10" in "\n".join(lines)
    result, lines = _run(shard_env, "crashed")
    assert result.resumed_from.endswith("step_00000008") and result.start_step == 8
    assert result.step == 12
    _assert_identical(_whole_checkpoint(shard_env, "straight", 12), _whole_checkpoint(shard_env, "crashed", 12))


@pytest.mark.integration
def test_sigterm_mid_training_checkpoints_that_step_and_the_resumed_run_equals_the_uninterrupted_one(
    shard_env, straight
):
    from lmyard.launch.follower import stop_all

    def on_line(line):
        if line.startswith("step 5/12"):  # the ranks pause after step 5 (an injected fault): a known step
            stop_all()  # what a cancelled flow run does: SIGTERM to torchrun's process group

    err, _ = _run(shard_env, "preempted", faults="pause@5", expect_fail=True, on_line=on_line)
    assert isinstance(err, Preempted) and "stopped by SIGTERM after step 5" in str(err)
    stopped_at = 5
    tmp, _ = shard_env
    assert stopped_at in complete_steps(Run("preempted", open_store(str(tmp / "store"))))
    result, _ = _run(shard_env, "preempted")
    assert result.start_step == stopped_at and result.step == 12  # no step lost, none repeated
    _assert_identical(_whole_checkpoint(shard_env, "straight", 12), _whole_checkpoint(shard_env, "preempted", 12))


@pytest.mark.integration
def test_resume_on_another_world_size_continues_the_same_token_stream(shard_env, straight):
    _run(shard_env, "two-ranks-crashed", faults="crash@5", expect_fail=True)
    result, lines = _run(shard_env, "two-ranks-crashed", nproc=1)
    assert any("from a checkpoint of 2" in ln for ln in lines) and result.step == 12
    # One rank reads both ranks' sequences with twice the accumulation: same data, same updates
    # up to float summation order.
    (m1, _), (m2, _) = _state(shard_env, "straight", 12), _state(shard_env, "two-ranks-crashed", 12)
    for k in m1:
        torch.testing.assert_close(m1[k], m2[k], rtol=2e-4, atol=2e-5)


MUON = {"train.optimizer": "muon"}


@pytest.fixture(scope="module")
def straight_muon(shard_env):
    """The uninterrupted run under train.optimizer=muon."""
    _run(shard_env, "straight-muon", **MUON)
    return "straight-muon"


@pytest.mark.integration
def test_a_muon_run_resumes_after_a_crash_bit_for_bit_its_momentum_in_the_checkpoint(shard_env, straight_muon):
    _run(shard_env, "crashed-muon", faults="crash@10", expect_fail=True, **MUON)
    result, _ = _run(shard_env, "crashed-muon", **MUON)
    assert result.start_step == 8 and result.step == 12
    whole = _whole_checkpoint(shard_env, straight_muon, 12)
    assert any("momentum_buffer" in s for s in whole[0]["optim.pt"]["state"].values())  # Muon's state is saved
    _assert_identical(whole, _whole_checkpoint(shard_env, "crashed-muon", 12))


@pytest.mark.integration
def test_a_muon_run_resumes_on_another_world_size(shard_env, straight_muon):
    _run(shard_env, "muon-two-ranks-crashed", faults="crash@5", expect_fail=True, **MUON)
    result, _ = _run(shard_env, "muon-two-ranks-crashed", nproc=1, **MUON)
    assert result.start_step == 4 and result.step == 12
    (m1, _), (m2, _) = _state(shard_env, straight_muon, 12), _state(shard_env, "muon-two-ranks-crashed", 12)
    # the same data and updates up to summation order, which Newton-Schulz magnifies: five bf16 iterations of slope
    # 3.4 at zero lift a gradient's smallest directions ~450x (measured: 1.4e-3 at most, weights of std 0.02)
    for k in m1:
        torch.testing.assert_close(m1[k], m2[k], rtol=0, atol=5e-3)


@pytest.mark.integration
def test_guard_rolls_back_on_a_nan_loss_and_continues(shard_env):
    result, lines = _run(shard_env, "nan-rollback", faults="nan_loss@6", **{"train.guard.policy": "rollback"})
    text = "\n".join(lines)
    assert "divergence at step 6: loss is nan; rolled back to" in text and "(step 4)" in text
    assert result.step == 12 and result.rollbacks == 1
    model, _ = _state(shard_env, "nan-rollback", 12)
    assert all(torch.isfinite(t).all() for t in model.values())


@pytest.mark.integration
def test_guard_stops_as_diverged_not_a_user_error_when_policy_is_stop(shard_env):
    err, _ = _run(shard_env, "nan-stop", faults="nan_loss@6", expect_fail=True)
    assert isinstance(err, Diverged) and "training diverged at step 6: loss is nan" in str(err)


@pytest.mark.integration
def test_k_micro_steps_equal_one_step_on_a_k_times_larger_batch():
    def fresh():
        torch.manual_seed(0)
        m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        return m, torch.optim.SGD(m.parameters(), lr=1e-2)  # AdamW's normalisation would amplify float noise

    def _parts(model, opt):
        return StepParts(model, list(model.parameters()), opt, torch.autocast("cpu", enabled=False), False, 1.0)

    torch.manual_seed(1)
    x = torch.randint(0, 64, (8, 17))
    big_model, big_opt = fresh()
    train_step(_parts(big_model, big_opt), iter([(x[:, :-1], x[:, 1:])]).__next__, 1, 1e-2)
    acc_model, acc_opt = fresh()
    micro = iter([(x[i : i + 2, :-1], x[i : i + 2, 1:]) for i in range(0, 8, 2)])
    train_step(_parts(acc_model, acc_opt), micro.__next__, 4, 1e-2)
    for p, q in zip(big_model.parameters(), acc_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_shard_vocabulary_larger_than_the_model_is_refused(shard_env):
    err, _ = _run(shard_env, "small-vocab", expect_fail=True, **{"model.vocab_size": 128})
    assert isinstance(err, UserError) and "smaller than the shard set's vocabulary (257" in str(err)


@pytest.mark.integration
def test_model_init_from_a_hugging_face_folder_continues_from_its_weights(shard_env, straight):
    from lmyard.export.hf import export

    tmp, _ = shard_env
    folder = tmp / "hf-straight"
    export(str(tmp / "store" / "runs" / "straight"), str(folder), 12)
    result, lines = _run(
        shard_env,
        "from-hf",
        steps=1,
        **{"model.init_from": str(folder), "train.lr": 1e-12, "train.warmup_steps": 1, "checkpoint.interval": 1},
    )
    assert result.step == 1 and any(ln.startswith("initialised from") for ln in lines)
    (start, _), (continued, _) = _state(shard_env, "straight", 12), _state(shard_env, "from-hf", 1)
    for name in start:  # one step at lr 1e-12 from the exported weights: the same weights
        torch.testing.assert_close(continued[name], start[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.integration
def test_doc_mask_trains_to_a_finite_loss_and_exports_as_a_causal_model(shard_env):
    """`--set model.doc_mask=true` on the smoke recipe; Hugging Face's model of it runs causal attention; that
    folder continued with model.init_from and model.doc_mask trains masked again."""
    from lmyard.export.hf import export

    tmp, _ = shard_env
    result, _ = _run(shard_env, "doc-mask", nproc=1, steps=3, **{"model.doc_mask": "true", "checkpoint.interval": 3})
    assert result.step == 3 and math.isfinite(result.train_loss) and math.isfinite(result.val_loss)
    run = tmp / "store" / "runs" / "doc-mask"
    state = json.loads((run / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["model"]["doc_bos"] == 256 and state["model"]["doc_eos"] is None  # bytes: <|endoftext|> before
    export(str(run), str(tmp / "hf-doc-mask"), 3)
    config = json.loads((tmp / "hf-doc-mask" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and not any(k.startswith("doc_") for k in config)
    assert json.loads((tmp / "hf-doc-mask" / "lmyard_export.json").read_text())["doc_mask"] is True
    # and back: a Hugging Face folder continued with model.doc_mask masks again
    again = {"model.doc_mask": "true", "model.init_from": str(tmp / "hf-doc-mask"), "checkpoint.interval": 1}
    result, _ = _run(shard_env, "doc-mask-from-hf", nproc=1, steps=1, **again)
    state = json.loads(
        (tmp / "store" / "runs" / "doc-mask-from-hf" / "checkpoints" / "step_00000001" / "state.json").read_text()
    )
    assert result.step == 1 and state["model"]["doc_bos"] == 256
