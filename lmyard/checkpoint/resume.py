"""Reading checkpoints back, either format: resume, rollback, evaluation, export.

    load_step(run, step, cache_dir)        the whole state on one process (an evaluator, an export)
    load_into(..., model, optimizer)       into a live model: sharded (every rank its shards, any world
                                           size) or plain (every rank the whole state)
    find_latest(run, cache_dir, load)      the newest checkpoint that loads; damaged ones skipped
    load_latest(..., model, optimizer)     find_latest + load_into, after checking the model's shape

Design notes: docs/checkpoints.md, `lmyard/checkpoint/resume.py`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar, cast, overload

import torch

from lmyard.checkpoint.catalog import complete_steps, read_manifest, read_state
from lmyard.checkpoint.full import read_full
from lmyard.checkpoint.manifest import DamagedCheckpoint
from lmyard.checkpoint.ranks import agree, gather
from lmyard.checkpoint.state import Checkpoint, Loaded
from lmyard.errors import UserError
from lmyard.retry import Backoff, retrying
from lmyard.run import Run

log = logging.getLogger(__name__)
T = TypeVar("T")


def load_step(run: Run, step: int, cache_dir: str, optimizer: bool = True) -> Checkpoint:
    """Checkpoint `step`, either format, whole on this process, verified against its manifest (`optimizer=False`:
    a sharded checkpoint's optimizer state is not read). DamagedCheckpoint when its bytes are wrong."""
    manifest = read_manifest(run, step)
    if manifest.format == "dcp":
        from lmyard.checkpoint.dcp_load import load_full  # torch's DCP and DTensor: imported only where read

        return load_full(run, step, cache_dir, optimizer=optimizer)
    return read_full(run, manifest, cache_dir)


def load_complete(run: Run, step: int, cache_dir: str, hint: str, optimizer: bool = True):
    """`load_step` for an operator command: a damaged checkpoint (or one that does not load) is a UserError naming
    it, the complete steps, and `hint` (what to give instead, e.g. "give another step with --step")."""
    import pickle

    try:
        return load_step(run, step, cache_dir, optimizer=optimizer)
    except (ValueError, OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(
            f"checkpoint {run.uri(run.layout.step(step))} is damaged ({str(e).splitlines()[0]}); "
            f"{hint} (complete steps: {complete_steps(run)})"
        ) from None


def load_into(
    run: Run,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    *,
    sharded: bool,
    group=None,
) -> Loaded:
    """Checkpoint `step`, either format, into `model` and `optimizer`: a sharded (FSDP2) model on every rank
    together, or a plain one (each rank reads the whole state)."""
    if sharded and read_manifest(run, step).format == "dcp":
        from lmyard.checkpoint.dcp_load import load_sharded  # torch's DCP and DTensor: only a sharded model's

        return load_sharded(run, step, model, optimizer, cache_dir, group)
    ckpt = load_step(run, step, cache_dir)
    if sharded:
        from lmyard.checkpoint.dcp_load import load_full_into

        load_full_into(model, optimizer, ckpt)
    else:
        model.load_state_dict(ckpt.model)
        if optimizer is not None:
            optimizer.load_state_dict(ckpt.optim)
    return Loaded(ckpt.step, ckpt.uri, ckpt.rng, ckpt.state)


def _together(load: Callable[[int], T], group) -> Callable[[int], T]:
    """`load` on every rank, failing on every rank if it failed on any: DamagedCheckpoint if any rank found
    damage (at 2 ranks only one may read the damaged file), else the error."""

    def loaded(step: int) -> T:
        result, error = None, None
        try:
            result = load(step)
        except Exception as e:
            error = e
        said = None if error is None else (type(error).__name__, str(error).splitlines()[0])
        failed = [(rank, s) for rank, s in enumerate(gather(said, group)) if s]
        if not failed:  # so this rank did not fail either: `load` returned `result`
            return cast(T, result)
        if isinstance(error, (DamagedCheckpoint, UserError)):
            raise error
        damaged = [s for _, s in failed if s[0] == DamagedCheckpoint.__name__]
        if damaged:
            raise DamagedCheckpoint(damaged[0][1])
        raise error if error is not None else RuntimeError(f"rank {failed[0][0]}: {failed[0][1][1]}")

    return loaded


@overload
def find_latest(
    run: Run,
    cache_dir: str,
    load: None = None,
    *,
    group=None,
    read_attempts: int = 3,
    backoff_s: float = 2.0,
) -> tuple[Checkpoint | None, list[int]]: ...


@overload
def find_latest(
    run: Run,
    cache_dir: str,
    load: Callable[[int], T],
    *,
    group=None,
    read_attempts: int = 3,
    backoff_s: float = 2.0,
) -> tuple[T | None, list[int]]: ...


def find_latest(
    run: Run,
    cache_dir: str,
    load: Callable[[int], object] | None = None,
    *,
    group=None,
    read_attempts: int = 3,
    backoff_s: float = 2.0,
) -> tuple[object, list[int]]:
    """(the newest checkpoint that `load(step)` loads, the damaged steps skipped on the way); see the module doc.
    `load` defaults to `load_step` (the whole state on this process)."""
    load = _together(load or (lambda step: load_step(run, step, cache_dir)), group)
    damaged: list[int] = []
    for step in reversed(agree(complete_steps(run), group)):
        try:
            return retrying(
                functools.partial(load, step),
                Backoff(backoff_s),
                read_attempts,
                fatal=(DamagedCheckpoint, UserError),
                on_failure=functools.partial(_say_read_failed, step),
            ), damaged
        except DamagedCheckpoint as e:
            msg = (
                f"warning: checkpoint {run.uri(run.layout.step(step))} is damaged "
                f"({str(e).splitlines()[0]}); falling back to the previous one"
            )
            log.warning(msg)
            print(msg, flush=True)
            damaged.append(step)
    return None, damaged


def _say_read_failed(step: int, e: Exception, attempt: int, delay: float | None) -> None:
    if delay is not None:
        print(f"reading checkpoint step {step} failed ({type(e).__name__}: {str(e)[:200]}); retrying", flush=True)


def load_latest(
    run: Run,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cache_dir: str,
    *,
    sharded: bool,
    group=None,
    model_spec: dict | None = None,
) -> tuple[Loaded | None, list[int]]:
    """The newest checkpoint loaded into `model` and `optimizer` (find_latest), and the damaged steps skipped.
    `model_spec` (lmyard.models.registry.model_spec of `model`): a checkpoint of another shape is a UserError."""

    def load(step: int) -> Loaded:
        if model_spec is not None:
            check_shape(run, step, model_spec)
        return load_into(run, step, model, optimizer, cache_dir, sharded=sharded, group=group)

    return find_latest(run, cache_dir, load, group=group)


def _shape(spec: dict) -> dict:
    """The fields of a model spec that decide its tensors' shapes: the architecture and its integer sizes."""
    return {"arch": spec.get("arch", "gpt2")} | {
        k: v for k, v in spec.items() if isinstance(v, (int, bool)) and k != "arch"
    }


def check_shape(run: Run, step: int, model_spec: dict) -> None:
    """UserError when checkpoint `step` holds a model of another shape than `model_spec` (its state.json says;
    a state.json that does not parse is left to the load, which calls it damaged)."""
    try:
        saved = read_state(run, step).model
    except ValueError:
        return
    if not saved:  # a state written without a model spec
        return
    old, new = _shape(saved), _shape(model_spec)
    if old == new:
        return
    keys = [k for k in new | old if old.get(k) != new.get(k)]

    def shape(spec: dict) -> str:
        return " ".join(f"{k}={spec.get(k)}" for k in keys)

    raise UserError(
        f"run '{run.name}' has checkpoint step {step} of another model ({shape(old)}) than this config builds "
        f"({shape(new)}); use a new run_name or model.init_from to start from other weights"
    )
