"""Sharded (DCP) checkpoints: FSDP2 on 2 CPU ranks (gloo), resharding, damage, S3, interop, retention."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_helpers import load_latest_sharded, save_full, save_sharded
from conftest import free_port
from torch import nn

from lmyard.checkpoint import dcp as sc
from lmyard.checkpoint import dcp_load, retention
from lmyard.checkpoint.catalog import complete_steps, read_manifest, read_state
from lmyard.checkpoint.commit import StepExists
from lmyard.checkpoint.manifest import DamagedCheckpoint
from lmyard.checkpoint.readahead import tensor_in
from lmyard.checkpoint.resume import load_step
from lmyard.checkpoint.state import rng_state
from lmyard.config import CheckpointConfig
from lmyard.errors import StoreOutage
from lmyard.layout import RunLayout
from lmyard.paths import sha256_file
from lmyard.run import Run
from lmyard.store import open_store

pytestmark = pytest.mark.slow
RUN = "r"


# ---------------------------------------------------------------- the ranks' side (run in spawned processes)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def _state(step: int, **extra) -> dict:
    """A state.json (lmyard.checkpoint.schema.CheckpointState) for step `step`."""
    return {
        "step": step,
        "cursor": 10 * step,
        "tokens_seen": 100 * step,
        "world_size": 2,
        "shard_address": "a",
        "config": {},
        "model": {},
        **extra,
    }


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _local(model, opt) -> dict:
    """This rank's shards, as plain tensors (what a bitwise comparison needs)."""

    def plain(t):
        return t.to_local().clone() if hasattr(t, "to_local") else t.clone() if torch.is_tensor(t) else t

    sd = sc.state_dict(model, opt)
    return {
        "model": {k: plain(v) for k, v in sd["model"].items()},
        "optim": {k: {n: plain(v) for n, v in s.items()} for k, s in sd["optim"]["state"].items()},
        "groups": sd["optim"]["param_groups"],
    }


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o.get("state"), "groups": o.get("param_groups")}  # empty but on rank 0


def _save_steps(rank, world, tmp, store):
    model = _fsdp(_model())
    opt = _optimizer(model)
    ckpt = sc.ShardedCheckpointer(Run(RUN, store), f"{tmp}/staging-{rank}", say=print)
    for step in (2, 4):
        _train(model, opt, 2, seed=step)
        if step == 2:
            ckpt.prepare(model, opt)  # the staging buffers, made in the background as a trainer does
        rng = [None] * world
        dist.all_gather_object(rng, rng_state())
        blocked = ckpt.save(model, opt, _state(step, val_loss=1.0 / step), rng)
        ckpt.before_update()
        torch.save(_local(model, opt), f"{tmp}/rank{rank}_step{step}.pt")
        full = _full(model, opt)
        if rank == 0:
            torch.save(full, f"{tmp}/full_step{step}.pt")
            json.dump({"blocked_s": blocked}, open(f"{tmp}/blocked_{step}.json", "w"))
    _train(model, opt, 1, seed=99)  # the live state moves on while the uploads finish
    ckpt.close()
    dist.barrier()  # close() returns on rank 1 once its files are up, on rank 0 once the step is committed


def _load_fresh(rank, tmp, store, out):
    """A fresh model (other weights) and optimizer (no state) load the newest checkpoint; the ranks' warnings."""
    model = _fsdp(_model(seed=7))
    opt = _optimizer(model)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        loaded = load_latest_sharded(Run(RUN, store), model, opt, f"{tmp}/cache-{rank}")
    torch.save(
        {"step": loaded.step, "state": loaded.state.model_dump(), **_local(model, opt)}, f"{tmp}/{out}_rank{rank}.pt"
    )
    open(f"{tmp}/{out}_rank{rank}.log", "w").write(said.getvalue())


def _damage(tmp):
    shutil.copytree(f"{tmp}/store", f"{tmp}/damaged")
    shard = f"{tmp}/damaged/{RunLayout(RUN).step(4)}/dcp/__1_0.distcp"
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))


def _ddp_checkpoint_into_fsdp(rank, tmp, store):
    if rank == 0:  # today's `ddp` path: full state dicts from the plain model, rank 0 writes them
        plain = _model()
        opt = _optimizer(plain)
        _train(plain, opt, 3)
        save_full(Run("ddp", store), 3, plain.state_dict(), opt.state_dict(), [], _state(3), f"{tmp}/staging")
        torch.save(_full(plain, opt), f"{tmp}/plain.pt")
    dist.barrier()
    model = _fsdp(_model(seed=5))
    opt = _optimizer(model)
    assert load_latest_sharded(Run("ddp", store), model, opt, f"{tmp}/cache-{rank}").step == 3
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, f"{tmp}/fsdp.pt")


def _s3_round_trip(rank, tmp, uri):
    store = open_store(uri)
    model = _fsdp(_model())
    opt = _optimizer(model)
    _train(model, opt, 3)
    save_sharded(Run(RUN, store), model, opt, _state(3), f"{tmp}/staging-{rank}")  # synchronous: returns once committed
    before = _local(model, opt)
    model2 = _fsdp(_model(seed=5))
    opt2 = _optimizer(model2)
    assert load_latest_sharded(Run(RUN, store), model2, opt2, f"{tmp}/cache-{rank}").step == 3
    _assert_equal(before, _local(model2, opt2))


def _one_rank_cannot_upload(rank, tmp):
    # rank 1's store is unusable (its root is under a file): its uploads keep failing, rank 0 never sees its marker
    root = f"{tmp}/store" if rank == 0 else f"{tmp}/not-a-folder/store"
    if rank == 1:
        open(f"{tmp}/not-a-folder", "w").close()
    if rank == 0:  # rank 1's marker of an earlier attempt at this step must not count
        open_store(root).write_bytes(
            RunLayout(RUN).rank_marker(6, 1), json.dumps({"rank": 1, "attempt": "earlier", "files": {}}).encode()
        )
    model = _fsdp(_model())
    opt = _optimizer(model)
    said = []
    ckpt = sc.ShardedCheckpointer(
        Run(RUN, open_store(root)),
        f"{tmp}/staging-{rank}",
        max_pending=1,
        retries=1,
        backoff_s=0.1,
        say=said.append,
    )
    ckpt.commit_timeout_s = 3
    ckpt.save(model, opt, _state(6), [])
    if rank == 0:
        with pytest.raises(StoreOutage, match="ranks \\[1\\] did not upload their shards within 3 s"):
            ckpt.flush()
        return
    # rank 1 keeps retrying (training would go on) until max_pending checkpoints wait, then says where they are
    with pytest.raises(StoreOutage, match="checkpoints of steps \\[6\\] are still not in"):
        ckpt.flush(timeout_s=3)
    with pytest.raises(StoreOutage, match=f"steps \\[6\\]\\) are waiting for .*staged in {tmp}/staging-1"):
        ckpt.save(model, opt, _state(7), [])
    assert any("keeping it pending" in line for line in said), said
    with pytest.raises(StoreOutage):
        ckpt.close(timeout_s=0.5)


def _llama_with_activation_checkpointing(rank, world, tmp):
    """lmyard's Llama as `train.parallel=fsdp` wraps it (checkpoint_wrapper per block, FSDP2 units)."""
    from lmyard.config import ModelConfig
    from lmyard.models.registry import build_model
    from lmyard.train.distributed.parallel import apply_activation_checkpointing, apply_fsdp, fsdp_mesh

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny"), 300)
    apply_activation_checkpointing(model, "full")
    apply_fsdp(model, fsdp_mesh(world, torch.device("cpu")), torch.device("cpu"))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
    idx = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(rank))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    save_sharded(Run("llama", open_store(f"{tmp}/store")), model, opt, _state(1), f"{tmp}/staging-{rank}")
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, f"{tmp}/llama_full.pt")


def _task_scenario(rank, world, tmp, s3_uri):
    """Every 2-rank case in one pair of processes (starting them costs more than the cases)."""
    store = open_store(f"{tmp}/store")
    _save_steps(rank, world, tmp, store)
    _load_fresh(rank, tmp, store, "loaded")
    if rank == 0:
        _damage(tmp)
    dist.barrier()
    _load_fresh(rank, tmp, open_store(f"{tmp}/damaged"), "fallback")
    _ddp_checkpoint_into_fsdp(rank, tmp, store)
    _s3_round_trip(rank, tmp, s3_uri)
    _llama_with_activation_checkpointing(rank, world, tmp)
    os.makedirs(f"{tmp}/broken", exist_ok=True)
    _one_rank_cannot_upload(rank, f"{tmp}/broken")


def _worker(rank, world, port, task, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        globals()[task](rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _spawn(task: str, world: int, *args) -> None:
    mp.spawn(_worker, args=(world, free_port(), task, args), nprocs=world, join=True)


# ---------------------------------------------------------------- helpers of the test side


def _assert_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, s3_server):
    """Two FSDP2 ranks run every 2-rank case (see _task_scenario); their outputs, for the tests to check."""
    tmp = tmp_path_factory.mktemp("sharded")
    bucket = s3_server.new_bucket()
    try:
        _spawn("_task_scenario", 2, str(tmp), f"s3://{bucket}/lmyard")
        yield tmp, open_store(f"s3://{bucket}/lmyard")
    finally:
        s3_server.remove_bucket(bucket)


@pytest.fixture
def one_rank():
    """A process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _load(path):
    return torch.load(path, weights_only=False)


# ---------------------------------------------------------------- tests


def test_sharded_checkpoint_layout_every_file_in_the_manifest_written_last(ranks):
    tmp, _ = ranks
    store = open_store(str(tmp / "store"))
    assert complete_steps(Run(RUN, store)) == [2, 4]
    prefix = store.local_path(RunLayout(RUN).step(4))
    manifest = read_manifest(Run(RUN, store), 4)
    assert manifest.format == "dcp" and manifest.world_size == 2 and manifest.val_loss == 0.25
    assert set(manifest.files) == {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng.pt", "state.json"}
    for name, meta in manifest.files.items():
        path = os.path.join(prefix, name)
        assert os.path.getsize(path) == meta.bytes and sha256_file(path) == meta.sha256
        assert os.path.getmtime(path) <= os.path.getmtime(os.path.join(prefix, "manifest.json"))
    assert read_state(Run(RUN, store), 4).cursor == 40
    assert not os.listdir(tmp / "staging-0" / RUN) and not os.listdir(tmp / "staging-1" / RUN)


def test_two_rank_checkpoint_resumes_bitwise_on_two_ranks(ranks):
    tmp, _ = ranks
    for rank in (0, 1):
        loaded = _load(tmp / f"loaded_rank{rank}.pt")
        assert loaded.pop("step") == 4 and loaded.pop("state")["cursor"] == 40
        _assert_equal(_load(tmp / f"rank{rank}_step4.pt"), loaded)


def test_two_rank_checkpoint_reshards_onto_one_rank(ranks, one_rank, tmp_path):
    tmp, _ = ranks
    model = _fsdp(_model(seed=7))
    opt = _optimizer(model)
    loaded = load_latest_sharded(Run(RUN, open_store(str(tmp / "store"))), model, opt, str(tmp_path))
    assert loaded.step == 4 and len(loaded.rng) == 2
    _assert_equal(_load(tmp / "full_step4.pt"), _full(model, opt))


def test_sharded_checkpoint_reads_whole_without_a_process_group_into_a_plain_model(ranks, tmp_path):
    tmp, _ = ranks
    # the evaluator's, the export's and a `ddp` resume's way: full state dicts, no process group
    ckpt = load_step(Run(RUN, open_store(str(tmp / "store"))), 4, str(tmp_path))
    plain = _model(seed=3)
    opt = _optimizer(plain)
    plain.load_state_dict(ckpt.model)
    opt.load_state_dict(ckpt.optim)
    _assert_equal(_load(tmp / "full_step4.pt"), _full(plain, opt))
    assert len(ckpt.rng) == 2 and ckpt.state.step == 4
    other = _model(seed=4)  # or straight into a plain model and its optimizer
    other_opt = _optimizer(other)
    assert dcp_load.load_sharded(Run(RUN, open_store(str(tmp / "store"))), 4, other, other_opt, str(tmp_path)).step == 4
    _assert_equal(_load(tmp / "full_step4.pt"), _full(other, other_opt))
    weights_only = _model(seed=5)  # the model alone (an evaluator's)
    dcp_load.load_sharded(Run(RUN, open_store(str(tmp / "store"))), 4, weights_only, None, str(tmp_path))
    _assert_equal(_load(tmp / "full_step4.pt")["model"], weights_only.state_dict())
    model_only = dcp_load.load_full(Run(RUN, open_store(str(tmp / "store"))), 4, str(tmp_path), optimizer=False)
    _assert_equal(_load(tmp / "full_step4.pt")["model"], model_only.model)
    assert model_only.optim == {"state": {}, "param_groups": []}


def test_damaged_shard_file_is_named_and_the_ranks_fall_back_to_the_previous_checkpoint(ranks, tmp_path):
    tmp, _ = ranks
    store = open_store(str(tmp / "damaged"))
    plain = _model()
    with pytest.raises(ValueError, match="step_00000004/dcp/__1_0.distcp does not match its manifest checksum"):
        dcp_load.load_sharded(Run(RUN, store), 4, plain, _optimizer(plain), str(tmp_path))
    # at 2 ranks only rank 1 reads that file: both ranks fell back together, with a warning naming it
    for rank in (0, 1):
        loaded = _load(tmp / f"fallback_rank{rank}.pt")
        assert loaded.pop("step") == 2 and loaded.pop("state")["step"] == 2
        _assert_equal(_load(tmp / f"rank{rank}_step2.pt"), loaded)
        said = (tmp / f"fallback_rank{rank}.log").read_text()
        assert f"checkpoint {store.uri(RunLayout(RUN).step(4))} is damaged" in said
        assert "__1_0.distcp" in said


def test_a_rank_that_cannot_upload_leaves_the_step_without_manifest_invisible(ranks):
    # rank 0 waited for rank 1's marker of this attempt (an earlier attempt's was there), then gave up
    tmp, _ = ranks
    store = open_store(str(tmp / "broken" / "store"))
    keys = store.list(RunLayout(RUN).checkpoints)
    assert any(k.endswith("dcp/__0_0.distcp") for k in keys) and not any("manifest" in k for k in keys)
    assert complete_steps(Run(RUN, store)) == []


def test_sharded_checkpoint_round_trips_through_s3(ranks, tmp_path):
    _, store = ranks  # the ranks saved and loaded it back bitwise; here it is read from S3 on one process
    assert complete_steps(Run(RUN, store)) == [3]
    assert len([k for k in store.list(RunLayout(RUN).step(3)) if k.endswith(".distcp")]) == 2
    ckpt = load_step(Run(RUN, store), 3, str(tmp_path))
    assert ckpt.uri.startswith("s3://") and set(ckpt.model) == set(_model().state_dict())


def test_llama_sharded_under_activation_checkpointing_loads_into_a_plain_llama(ranks, tmp_path):
    from lmyard.config import ModelConfig
    from lmyard.models.registry import build_model

    tmp, _ = ranks
    ckpt = load_step(Run("llama", open_store(str(tmp / "store"))), 1, str(tmp_path))
    plain = build_model(ModelConfig(preset="llama-tiny"), 300)
    opt = torch.optim.AdamW(plain.param_groups(0.1), lr=1e-3)
    plain.load_state_dict(ckpt.model)  # no `_checkpoint_wrapped_module` in the names: a plain model's keys
    opt.load_state_dict(ckpt.optim)
    _assert_equal(_load(tmp / "llama_full.pt"), _full(plain, opt))


def test_ddp_checkpoint_loads_into_the_fsdp_model(ranks):
    tmp, _ = ranks
    _assert_equal(_load(tmp / "plain.pt"), _load(tmp / "fsdp.pt"))


def test_retention_deletes_sharded_checkpoints_like_others(tmp_path):
    store = open_store(str(tmp_path / "store"))
    model = _model()
    for step in range(1, 6):  # without a process group: one rank's sharded checkpoint
        save_sharded(Run(RUN, store), model, _optimizer(model), _state(step, val_loss=5.0 - step), str(tmp_path / "s"))
    save_full(
        Run(RUN, store), 6, model.state_dict(), {"state": {}, "param_groups": []}, [], _state(6), str(tmp_path / "s")
    )
    deleted = retention.apply(Run(RUN, store), CheckpointConfig(keep_last=2, keep_every=4, keep_best=False))
    assert deleted == [1, 2, 3] and complete_steps(Run(RUN, store)) == [4, 5, 6]
    for step in deleted:
        assert store.list(RunLayout(RUN).step(step)) == []


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned-marker",))


def test_loading_a_sharded_checkpoint_never_unpickles_arbitrary_objects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(str(tmp_path / "store"))
    model = _model()
    for step in (4, 8):
        save_sharded(Run(RUN, store), model, _optimizer(model), _state(step), str(tmp_path / "s"))
    prefix = store.local_path(RunLayout(RUN).step(8))
    with open(os.path.join(prefix, "dcp", ".metadata"), "wb") as f:  # a malicious index, its checksum made to match
        pickle.dump({"x": _Payload()}, f)
    manifest = json.loads(open(os.path.join(prefix, "manifest.json")).read())
    manifest["files"]["dcp/.metadata"] = {"bytes": os.path.getsize(os.path.join(prefix, "dcp", ".metadata"))}
    manifest["files"]["dcp/.metadata"]["sha256"] = sha256_file(os.path.join(prefix, "dcp", ".metadata"))
    open(os.path.join(prefix, "manifest.json"), "w").write(json.dumps(manifest))
    fresh = _model(seed=9)
    assert load_latest_sharded(Run(RUN, store), fresh, _optimizer(fresh), str(tmp_path / "cache")).step == 4
    assert not (tmp_path / "pwned-marker").exists()
    with pytest.raises(DamagedCheckpoint, match="refers to (os|posix).system, which a checkpoint may not"):
        load_step(Run(RUN, store), 8, str(tmp_path / "cache"))


def test_a_complete_sharded_step_is_never_overwritten(tmp_path):
    store = open_store(str(tmp_path / "store"))
    model = _model()
    save_sharded(Run(RUN, store), model, _optimizer(model), _state(2), str(tmp_path / "s"))
    manifest = read_manifest(Run(RUN, store), 2)
    other = _model(seed=3)
    with pytest.raises(StepExists, match="step_00000002 already exists complete"):
        save_sharded(Run(RUN, store), other, _optimizer(other), _state(2), str(tmp_path / "s"))
    assert read_manifest(Run(RUN, store), 2) == manifest
    prefix = store.local_path(RunLayout(RUN).step(2))
    for name, meta in manifest.files.items():
        assert sha256_file(os.path.join(prefix, name)) == meta.sha256


def test_a_hung_upload_does_not_hold_up_the_next_sharded_saves_and_commits_stay_in_step_order(
    s3_server, tmp_path, monkeypatch
):
    from urllib.parse import urlparse

    from tcp_proxy import TcpProxy

    uri = f"s3://{s3_server.new_bucket()}/lmyard"
    direct = open_store(uri)  # the test's own view of the bucket, not through the proxy
    proxy = TcpProxy(urlparse(s3_server.endpoint).port)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    model = _model()
    opt = _optimizer(model)
    model(torch.zeros(2, 8)).sum().backward()
    opt.step()
    ckpt = sc.ShardedCheckpointer(Run(RUN, open_store(uri)), str(tmp_path / "staging"), max_pending=4, say=print)
    try:
        proxy.hold()  # the server hangs: the upload of step 1 neither ends nor fails
        ckpt.save(model, opt, _state(1), [])
        for step in (2, 3):
            t0 = time.monotonic()
            ckpt.save(model, opt, _state(step), [])
            assert time.monotonic() - t0 < 5, f"save of step {step} waited for the hung upload"
            ckpt.writing.result(timeout=20)  # DCP wrote this step's files to the staging folder meanwhile
            assert (tmp_path / "staging" / RUN / f"step_{step:08d}" / "rank_00000" / ".metadata").exists()
        assert complete_steps(Run(RUN, direct)) == []
        proxy.release()
        ckpt.flush(timeout_s=180)
        assert complete_steps(Run(RUN, direct)) == [1, 2, 3]
        committed = [read_manifest(Run(RUN, direct), step).committed for step in (1, 2, 3)]
        assert committed == sorted(committed)
    finally:
        proxy.release()
        ckpt.close(timeout_s=30)
        proxy.stop()


def _wide_checkpoint(tmp_path, files: int = 1) -> tuple:
    """A one-rank sharded checkpoint of ~25 MB (weights + AdamW moments) in `files` files and their total bytes."""
    store = open_store(str(tmp_path / "store"))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    save_sharded(Run(RUN, store), model, opt, _state(3), str(tmp_path / "s"), write_threads=files)
    folder = os.path.join(store.local_path(RunLayout(RUN).step(3)), "dcp")
    assert len([f for f in os.listdir(folder) if f.endswith(".distcp")]) == files
    return store, model, sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def _bytes_read() -> int:
    with open("/proc/self/io") as f:  # rchar: bytes this process read through read() calls, cache or disk
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's per-process I/O counters")
@pytest.mark.parametrize("files", [1, 4])
def test_resume_reads_each_byte_of_a_sharded_checkpoint_once_and_loads_it_exactly(tmp_path, files):
    """One file a rank, or four (checkpoint.files_per_rank) read and hashed in parallel lanes."""
    store, saved, size = _wide_checkpoint(tmp_path, files)
    torch.manual_seed(1)
    fresh = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))
    before = _bytes_read()
    dcp_load.load_sharded(
        Run(RUN, store), 3, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), str(tmp_path / "c")
    )
    read = _bytes_read() - before
    assert size <= read < 1.2 * size, f"read {read} bytes for {size} bytes of files"  # checked and loaded in one pass
    _assert_equal(saved.state_dict(), fresh.state_dict())


@pytest.mark.parametrize("damage", ["a byte flipped near the end", "truncated"])
@pytest.mark.parametrize("files, damaged", [(1, "__0_0.distcp"), (4, "__0_2.distcp")])
def test_a_sharded_file_damaged_past_its_first_tensors_is_named_and_nothing_hangs(tmp_path, damage, files, damaged):
    """Also when it is one of a rank's four files, read in lanes beside the others."""
    store, _, _ = _wide_checkpoint(tmp_path, files)
    shard = os.path.join(store.local_path(RunLayout(RUN).step(3)), "dcp", damaged)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        if damage == "truncated":
            f.truncate(size - 1000)
        else:
            f.seek(size - 5000)
            byte = f.read(1)
            f.seek(size - 5000)
            f.write(bytes([byte[0] ^ 0xFF]))
    fresh = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))
    with pytest.raises(DamagedCheckpoint, match=f"step_00000003/dcp/{damaged} does not match its manifest checksum"):
        dcp_load.load_sharded(
            Run(RUN, store), 3, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), str(tmp_path / "c")
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("files", [1, 4])
def test_resume_onto_a_gpu_copies_from_the_reused_pinned_buffers_exactly(tmp_path, files):
    """One lane, or four whose pinned buffers are reused once the copies out of them have run."""
    store, saved, _ = _wide_checkpoint(tmp_path, files)
    torch.manual_seed(1)
    fresh = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8))).cuda()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh(torch.randn(4, 512, device="cuda")).sum().backward()
    opt.step()  # its moments exist, on the GPU, and differ from the checkpoint's
    phases: dict = {}
    dcp_load.load_sharded(Run(RUN, store), 3, fresh, opt, str(tmp_path / "c"), phases=phases)
    _assert_equal(saved.state_dict(), {k: v.cpu() for k, v in fresh.state_dict().items()})
    assert phases["copy"] > 0 and phases["hash"] > 0, phases


def test_staging_buffers_of_a_sharded_state_keep_its_sharding_and_take_an_exact_copy_of_every_shard(one_rank):
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten

    model = _fsdp(_model())
    opt = _optimizer(model)
    _train(model, opt, 2)
    live, _ = tree_flatten(sc.state_dict(model, opt))
    made, _ = tree_flatten(sc.pinned_like(sc.state_dict(model, opt)))
    assert len(made) == len(live) and any(isinstance(t, DTensor) for t in made)
    for t, c in zip(live, made):
        if not (torch.is_tensor(t) and t.dim() > 0):
            continue
        assert (type(c), c.shape, c.dtype) == (type(t), t.shape, t.dtype)
        assert not isinstance(t, DTensor) or c.placements == t.placements
        local, source = (c.to_local(), t.to_local()) if isinstance(c, DTensor) else (c, t)
        local.copy_(source)  # as DCP's writer stages into its cache (from the GPU where FSDP put the model)
        assert torch.equal(c.to_local() if isinstance(c, DTensor) else c, source.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_staging_buffers_made_ahead_are_pinned_and_shaped_like_the_state_and_the_save_into_them_is_exact(tmp_path):
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        model = _fsdp(_model().cuda())
        opt = _optimizer(model)
        _train(model, opt, 2)
        live, _ = tree_flatten(sc.state_dict(model, opt))
        made, _ = tree_flatten(sc.pinned_like(sc.state_dict(model, opt)))
        assert len(made) == len(live)
        for t, c in zip(live, made):
            if torch.is_tensor(t) and t.dim() > 0:
                local = c.to_local() if isinstance(c, DTensor) else c
                assert local.device.type == "cpu" and local.is_pinned() and (c.shape, c.dtype) == (t.shape, t.dtype)
                assert not isinstance(t, DTensor) or c.placements == t.placements
        store = open_store(str(tmp_path / "store"))
        ckpt = sc.ShardedCheckpointer(Run(RUN, store), str(tmp_path / "staging"), say=print)
        ckpt.prepare(model, opt)
        ckpt.save(model, opt, _state(2, world_size=1), [rng_state()])
        ckpt.before_update()
        saved = _local(model, opt)
        _train(model, opt, 1, seed=99)  # the live state moves on while the write finishes
        ckpt.close()
        fresh = _fsdp(_model(seed=7).cuda())
        fresh_opt = _optimizer(fresh)
        load_latest_sharded(Run(RUN, store), fresh, fresh_opt, str(tmp_path / "cache"))
        _assert_equal(saved, _local(fresh, fresh_opt))
    finally:
        dist.destroy_process_group()


def test_a_saved_tensor_is_read_as_a_view_of_its_spans_bytes():
    for t in (torch.randn(3, 5), torch.randn(4, 6).t(), torch.arange(10, dtype=torch.bfloat16), torch.tensor(3.0)):
        out = io.BytesIO()
        torch.save(t, out)
        span = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
        got = tensor_in(span)
        assert torch.equal(got, t) and got.stride() == t.stride() and got.dtype == t.dtype
        assert span.data_ptr() <= got.data_ptr() < span.data_ptr() + span.numel()  # no copy of the bytes


def test_a_span_holding_an_arbitrary_object_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.BytesIO()
    torch.save({"x": _Payload()}, out)  # a shard file's span, its checksum made to match
    with pytest.raises(pickle.UnpicklingError):
        tensor_in(torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8))
    assert not (tmp_path / "pwned-marker").exists()
