"""Checkpoints in S3 and locally: exact load, outages, cut uploads, damage, unpickling, retention."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import threading
import time
from urllib.parse import urlparse

import pytest
import torch
from checkpoint_helpers import load_latest, save_full
from conftest import tiny_overrides
from tcp_proxy import TcpProxy

from lmyard.checkpoint import manifest as manifest_module
from lmyard.checkpoint import retention
from lmyard.checkpoint.catalog import complete_steps, read_manifest
from lmyard.checkpoint.full import FullCheckpointer
from lmyard.checkpoint.resume import load_step
from lmyard.config import CheckpointConfig
from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import StoreOutage
from lmyard.launch.local_job import run_local
from lmyard.layout import RunLayout
from lmyard.paths import sha256_file
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_run(s3_server, tmp_path_factory):
    """A shard set in a fresh bucket, and a function that trains a tiny run against that store."""
    tmp = tmp_path_factory.mktemp("ckpt-s3")
    bucket = s3_server.new_bucket()
    store = f"s3://{bucket}/lmyard"
    cfg = load_recipe("smoke", tiny_overrides(tmp, store=store))
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)

    def run(run_name, *, steps=12, faults="", env=None, on_line=None, **extra):
        values = {"store": store, "run_name": run_name, "checkpoint.interval": 4, "eval.interval": 1000, **extra}
        cfg = load_recipe("smoke", tiny_overrides(tmp, steps=steps, **values))
        spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
        lines: list[str] = []
        saved = dict(os.environ)
        os.environ.update({"LMYARD_FAULTS": faults, "LMYARD_CACHE": str(tmp / f"cache-{run_name}"), **(env or {})})
        try:
            result = run_local(cfg, spec, on_line=lambda ln: (lines.append(ln), on_line and on_line(ln)))
            return result, lines
        except Exception as e:
            return e, lines
        finally:
            os.environ.clear()
            os.environ.update(saved)

    yield run, open_store(store), tmp
    s3_server.remove_bucket(bucket)


def _tensors(ckpt):
    return [
        t
        for tree in (ckpt.model, ckpt.optim["state"])
        for t in (
            tree.values()
            if isinstance(tree, dict) and "wte.weight" in tree
            else [v for s in tree.values() for v in s.values()]
        )
    ]


def test_checkpoints_round_trip_through_s3_and_resume_exactly(s3_run):
    run, store, tmp = s3_run
    run("s3-straight")
    err, lines = run("s3-crashed", faults="crash@10")
    assert isinstance(err, Exception) and "injected crash after step 10" in "\n".join(lines)
    result, lines = run("s3-crashed")
    assert not isinstance(result, Exception), result
    assert result.step == 12 and any("at step 8" in ln and "s3://" in ln for ln in lines)
    a = load_step(Run("s3-straight", store), 12, str(tmp / "load-a"))
    b = load_step(Run("s3-crashed", store), 12, str(tmp / "load-b"))
    assert a.state.cursor == b.state.cursor and a.uri.startswith("s3://")
    for x, y in zip(_tensors(a), _tensors(b), strict=True):
        assert torch.equal(x, y)


def test_store_outage_during_uploads_does_not_stop_training_and_checkpoints_land(s3_run, s3_server):
    run, store, _ = s3_run
    proxy = TcpProxy(urlparse(s3_server.endpoint).port)
    proxy.start()
    cut, seen = threading.Event(), set()

    def on_line(line):
        if "step 40/160 |" in line and not cut.is_set():  # step 40 is done: its save starts next
            cut.set()
            proxy.stop()  # cuts the upload of step 40 mid-flight
        seen.update(k for k in ("step 40: upload failed", "step 120/160 |") if k in line)
        if len(seen) == 2 and "back" not in seen:  # the store comes back while training goes on, not on a clock
            seen.add("back")
            proxy.start()

    try:
        result, lines = run(
            "outage",
            steps=160,
            on_line=on_line,
            env={"AWS_ENDPOINT_URL": proxy.url},
            **{
                "checkpoint.interval": 40,
                "checkpoint.upload_retries": 1,
                "checkpoint.max_pending": 4,
                "train.log_interval": 40,
            },
        )
    finally:
        proxy.stop()
    text = "\n".join(lines)
    assert not isinstance(result, Exception), text[-3000:]
    assert cut.is_set() and "upload failed" in text
    for step in (40, 80, 120, 160):
        assert f"checkpoint step {step} committed" in text
    assert complete_steps(Run("outage", store))[-1] == 160


def test_flush_gives_up_at_its_deadline_while_the_store_is_down_and_commits_once_it_is_back(
    s3_server, tmp_path, monkeypatch
):
    proxy = TcpProxy(urlparse(s3_server.endpoint).port)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    bucket = s3_server.new_bucket()
    store = open_store(f"s3://{bucket}/lmyard")
    proxy.stop()  # the store goes down before the first upload
    said: list[str] = []
    writer = FullCheckpointer(Run("down", store), str(tmp_path / "staging"), retries=1, backoff_s=0.1, say=said.append)
    try:
        writer.save_state({"w": torch.arange(4.0)}, {"state": {}, "param_groups": []}, _state(4), [])
        t0 = time.monotonic()
        with pytest.raises(StoreOutage, match=r"steps \[4\] are still not in s3://.* after 3 s.*staged in"):
            writer.flush(timeout_s=3)
        assert time.monotonic() - t0 < 30
        assert (tmp_path / "staging" / "down" / "step_00000004" / "model.pt").exists()
        assert any("upload failed" in line for line in said)
        proxy.start()
        writer.flush(timeout_s=90)  # the writer keeps retrying the staged copy
        assert complete_steps(Run("down", store)) == [4]
        loaded = load_latest(Run("down", store), str(tmp_path / "cache"))
        assert torch.equal(loaded.model["w"], torch.arange(4.0))
        writer.close(timeout_s=10)
    finally:
        proxy.stop()


def test_a_hung_upload_does_not_hold_up_the_next_saves_and_commits_stay_in_step_order(s3_server, tmp_path, monkeypatch):
    uri = f"s3://{s3_server.new_bucket()}/lmyard"
    direct = open_store(uri)  # the test's own view of the bucket, not through the proxy
    proxy = TcpProxy(urlparse(s3_server.endpoint).port)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    store = open_store(uri)
    staging = tmp_path / "staging" / "hung"
    writer = FullCheckpointer(Run("hung", store), str(tmp_path / "staging"), max_pending=4, say=lambda s: None)
    optim = {"state": {}, "param_groups": []}
    try:
        proxy.hold()  # the server hangs: the upload of step 1 neither ends nor fails
        writer.save_state({"w": torch.full((4,), 1.0)}, optim, _state(1), [])
        for step in (2, 3):
            t0 = time.monotonic()
            writer.save_state({"w": torch.full((4,), float(step))}, optim, _state(step), [])
            assert time.monotonic() - t0 < 5, f"save of step {step} waited for the hung upload"
            deadline = time.monotonic() + 20
            while not (staging / f"step_{step:08d}" / "state.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (staging / f"step_{step:08d}" / "model.pt").exists(), f"step {step} was not serialized"
        assert complete_steps(Run("hung", direct)) == []
        proxy.release()
        writer.flush(timeout_s=180)
        assert complete_steps(Run("hung", direct)) == [1, 2, 3]
        committed = [read_manifest(Run("hung", direct), step).committed for step in (1, 2, 3)]
        assert committed == sorted(committed)
        writer.close(timeout_s=10)
    finally:
        proxy.release()
        proxy.stop()


def test_upload_cut_by_a_dying_process_leaves_no_manifest_and_resume_uses_the_previous(s3_run):
    run, store, _ = s3_run
    err, lines = run("cut-upload", faults="crash_in_upload@8")
    assert isinstance(err, Exception)
    assert complete_steps(Run("cut-upload", store)) == [4]
    assert store.list(RunLayout("cut-upload").step(8)), "some files of step 8 were uploaded"
    result, lines = run("cut-upload")
    assert result.step == 12 and any("at step 4" in ln for ln in lines)
    assert complete_steps(Run("cut-upload", store))[-2:] == [8, 12]


def _state(step, val_loss=None):
    """A minimal lmyard.checkpoint.schema.CheckpointState."""
    return {
        "step": step,
        "val_loss": val_loss,
        "cursor": step,
        "tokens_seen": step,
        "world_size": 1,
        "shard_address": "a",
        "config": {},
        "model": {},
    }


def _save_local(store, run_name, step, val_loss=None, staging=None):
    model = {"w": torch.full((4,), float(step))}
    state = _state(step, val_loss)
    return save_full(Run(run_name, store), step, model, {"state": {}, "param_groups": []}, [], state, staging)


def test_damaged_newest_checkpoint_makes_the_loader_fall_back_and_say_which(tmp_path, capsys):
    store = open_store(str(tmp_path / "store"))
    _save_local(store, "r", 4, staging=str(tmp_path / "stage"))
    uri = _save_local(store, "r", 8, staging=str(tmp_path / "stage"))
    path = os.path.join(uri, "model.pt")
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF
    open(path, "wb").write(bytes(data))
    ckpt = load_latest(Run("r", store), str(tmp_path / "cache"))
    assert ckpt.step == 4 and torch.equal(ckpt.model["w"], torch.full((4,), 4.0))
    assert f"checkpoint {uri} is damaged" in capsys.readouterr().out


def test_a_file_over_one_piece_is_checked_piece_by_piece_and_a_byte_flipped_in_any_piece_is_damage(tmp_path):
    data = os.urandom(4 * 1000 + 500)
    path = tmp_path / "optim.pt"
    path.write_bytes(data)
    pieces = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manifest_module, "PIECE_BYTES", 1000)
        meta = manifest_module.file_meta(str(path))
        assert meta.sha256 == hashlib.sha256(data).hexdigest() and meta.pieces == pieces
        older = manifest_module.FileMeta(bytes=len(data), sha256=meta.sha256)  # a manifest of before the pieces
        assert manifest_module.matches(str(path), meta) and manifest_module.matches(str(path), older)
        for at in (0, 1999, len(data) - 1):
            flipped = bytearray(data)
            flipped[at] ^= 0x01
            path.write_bytes(bytes(flipped))
            assert not manifest_module.matches(str(path), meta) and not manifest_module.matches(str(path), older)
        path.write_bytes(data[:-1])
        assert not manifest_module.matches(str(path), meta)
    assert manifest_module.file_meta(str(path)).pieces is None  # one piece: the whole file's sha256 is enough


def test_a_checkpoint_damaged_in_one_piece_of_a_file_falls_back_to_the_one_before(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(manifest_module, "PIECE_BYTES", 256)
    store = open_store(str(tmp_path / "store"))
    _save_local(store, "r", 4, staging=str(tmp_path / "stage"))
    uri = _save_local(store, "r", 8, staging=str(tmp_path / "stage"))
    assert len(read_manifest(Run("r", store), 8).files["model.pt"].pieces or []) > 1
    assert load_latest(Run("r", store), str(tmp_path / "cache")).step == 8
    path = os.path.join(uri, "model.pt")
    data = bytearray(open(path, "rb").read())
    data[300] ^= 0xFF
    open(path, "wb").write(bytes(data))
    ckpt = load_latest(Run("r", store), str(tmp_path / "cache"))
    assert ckpt.step == 4 and torch.equal(ckpt.model["w"], torch.full((4,), 4.0))
    assert f"checkpoint {uri} is damaged" in capsys.readouterr().out


def test_a_verified_checkpoint_is_the_report_the_checkpoint_task_records(tmp_path):
    from lmyard.checkpoint.catalog import verify
    from tasks.results import CheckpointReport

    store = open_store(str(tmp_path / "store"))
    uri = _save_local(store, "r", 4, staging=str(tmp_path / "stage"))
    report = CheckpointReport.model_validate(verify(Run("r", store), 4))
    assert report.step == 4 and report.uri == uri and report.format == "full"
    assert report.files >= 3 and report.bytes > 0


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned-marker",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(str(tmp_path / "store"))
    _save_local(store, "r", 4, staging=str(tmp_path / "stage"))
    uri = _save_local(store, "r", 8, staging=str(tmp_path / "stage"))
    with open(os.path.join(uri, "model.pt"), "wb") as f:  # a malicious file, its checksum made to match
        pickle.dump({"w": _Payload()}, f)
    manifest = json.loads(open(os.path.join(uri, "manifest.json")).read())
    manifest["files"]["model.pt"] = {"bytes": os.path.getsize(os.path.join(uri, "model.pt"))}
    manifest["files"]["model.pt"]["sha256"] = sha256_file(os.path.join(uri, "model.pt"))
    open(os.path.join(uri, "manifest.json"), "w").write(json.dumps(manifest))
    ckpt = load_latest(Run("r", store), str(tmp_path / "cache"))
    assert ckpt.step == 4
    assert not (tmp_path / "pwned-marker").exists()


def test_retention_deletes_exactly_what_the_policy_says_on_s3(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    try:
        store = open_store(f"s3://{bucket}/p")
        losses = {1: 3.0, 2: 2.5, 3: 1.0, 4: 2.0, 5: 1.9, 6: 1.8, 7: 1.7, 8: 1.6, 9: 1.5, 10: 1.4}
        for step, loss in losses.items():
            _save_local(store, "r", step, loss, staging=str(tmp_path / "stage"))
        store.write_bytes("runs/r/protected.json", json.dumps({"steps": [5]}).encode())
        deleted = retention.apply(Run("r", store), CheckpointConfig(keep_last=2, keep_every=4, keep_best=True))
        assert deleted == [1, 2, 6, 7]
        assert complete_steps(Run("r", store)) == [3, 4, 5, 8, 9, 10]
        for step in deleted:
            assert store.list(RunLayout("r").step(step)) == []
    finally:
        s3_server.remove_bucket(bucket)


def test_retention_holds_checkpoints_until_their_evaluation_has_ended(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    try:
        store = open_store(f"s3://{bucket}/p")
        for step, loss in {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.9, 5: 1.8}.items():
            _save_local(store, "r", step, loss, staging=str(tmp_path / "stage"))
        policy = CheckpointConfig(keep_last=2, keep_best=True)
        retention.mark_evaluated(Run("r", store), 1, ok=True)
        retention.mark_evaluated(Run("r", store), 2, ok=False)  # a failed evaluation releases its checkpoint too
        assert retention.apply(Run("r", store), policy, hold_for_eval=True) == [1, 2]
        assert complete_steps(Run("r", store)) == [3, 4, 5]  # 3 is past the policy but not evaluated yet
        assert retention.apply(Run("r", store), policy) == [3]  # the plain policy, after the last evaluation
        assert load_latest(Run("r", store), str(tmp_path / "cache")).step == 5
    finally:
        s3_server.remove_bucket(bucket)


def test_retention_plan_keeps_last_every_best_and_protected():
    steps = [10, 20, 30, 40, 50]
    keep, delete = retention.plan(
        steps,
        {10: 1.0, 20: 0.5, 30: 0.7, 40: 0.9, 50: 0.8},
        CheckpointConfig(keep_last=2, keep_every=None, keep_best=True),
        {10},
    )
    assert keep == [10, 20, 40, 50] and delete == [30]


def test_keeping_fewer_than_two_checkpoints_is_refused():
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=1)


def test_a_lineage_rerun_with_another_model_shape_exits_2_naming_both_shapes(cli_env, tmp_path):
    """Same run_name, another preset: one line naming the run and both shapes, before any tensor is read, said
    once (not again by Prefect's lines); the checkpoint is not damage (no quarantine, no retry)."""
    import subprocess

    from conftest import lmyard_cmd

    overrides = tiny_overrides(tmp_path, steps=3, **{"run_name": "shape", "eval.interval": 100})
    cfg = load_recipe("smoke", overrides)
    shards, _ = tokenize_and_shard(cfg, log=lambda s: None)
    spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": None}
    run_local(cfg, spec, on_line=lambda line: None)  # the lineage's first checkpoint: a 2-layer GPT-2
    store = open_store(cfg.store)
    assert complete_steps(Run("shape", store)) == [3]
    again = subprocess.run(
        lmyard_cmd("run", "smoke", *[x for o in [*overrides, "model.preset=llama-tiny"] for x in ("--set", o)]),
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [ln for ln in again.stderr.splitlines() if ln.startswith("lmyard: error:")]
    assert len(errors) == 1, again.stderr[-3000:]
    assert "run 'shape'" in errors[0] and "arch=gpt2" in errors[0] and "arch=llama" in errors[0]
    assert "use a new run_name or model.init_from" in errors[0]
    assert "Traceback" not in again.stderr.split("lmyard: error:")[-1], again.stderr
    assert again.stderr.strip().splitlines()[-1] == errors[0]  # the last line
    assert (again.stdout + again.stderr).count("use a new run_name") == 1, again.stderr[-3000:]  # said once
    assert "retrying" not in again.stdout + again.stderr
    assert complete_steps(Run("shape", store)) == [3] and store.list("runs/shape/damaged") == []
