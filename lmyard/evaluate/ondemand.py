"""`lmyard eval` and `lmyard sample`: the evaluators of a run, on demand, on any model lmyard made.

A source is a lineage of the store (`RUN`, its newest complete checkpoint, or `--step N`), a checkpoint URI
(`STORE/runs/RUN[/checkpoints/step_NNNNNNNN]`), an export folder (`lmyard export`'s, with lmyard_export.json)
or a registered version (`models:/NAME/VERSION`, `models:/NAME@ALIAS`, `models:/NAME/latest`). `resolve` reads
only names and manifests, so a mistake (an unknown run, no checkpoint, an unknown task) is one line before any
weights are read; `load` then builds the model.

Design notes: docs/export.md, `lmyard/evaluate/ondemand.py`.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from lmyard.checkpoint import catalog, resume
from lmyard.config import EvalConfig, TokenizerConfig, redact_uri
from lmyard.errors import UserError
from lmyard.layout import RunLayout
from lmyard.run import Run
from lmyard.store import Store, open_store
from lmyard.tracking.registered import is_registered

BUILTIN = ("val_loss", "hellaswag")  # the evaluator's own measures; any other task is lm-eval's
LOGGED_PREFIX = "lmyard_eval/"


@dataclass
class Source:
    """Where a model is, resolved without reading its weights."""

    given: str
    kind: str  # "checkpoint", "folder" or "registered"
    store: str | None = None  # the store of a checkpoint, or the site's (a folder's shard set is looked up there)
    run_name: str | None = None
    step: int | None = None
    folder: str | None = None
    mlflow_run_id: str | None = None  # the lineage's MLflow run, when known
    notes: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=8)
def _store(uri: str) -> Store:
    """Each store a source names, opened once for the command."""
    return open_store(uri)


def resolve(given: str, step: int | None, store_uri: str, tracking_uri: str) -> Source:
    """The source `given` names (see the module doc); UserError naming what is wrong and what to give instead."""
    from lmyard.tracking.runs import run_names

    if is_registered(given):
        return _registered(given, step, store_uri, tracking_uri)
    located = RunLayout.locate(given)
    if located is None and os.path.isdir(given):
        return _folder(given, step, store_uri)
    if located is None and "/" not in given and not given.startswith("s3:"):
        store = _store(store_uri)
        if given not in run_names(store):
            known = ", ".join(run_names(store)) or "none"
            raise UserError(
                f"no lineage {given!r} in {redact_uri(store.uri('runs'))} (lineages there: {known}); give a run "
                "name of --store, a checkpoint URI, an export folder or models:/NAME/VERSION"
            )
        located = (store_uri, given, None)
    if located is None:
        raise UserError(
            f"{given!r} is not a run, a checkpoint, a folder or a registered model: give RUN (with --store), "
            "STORE/runs/RUN[/checkpoints/step_NNNNNNNN], an export folder or models:/NAME/VERSION (or @ALIAS)"
        )
    root, run, in_uri = located
    if in_uri is not None and step is not None and in_uri != step:
        raise UserError(f"{given} is the checkpoint of step {in_uri} but --step says {step}: give one of them")
    return _checkpoint(given, root, run, in_uri if in_uri is not None else step)


def _checkpoint(given: str, root: str, run: str, step: int | None) -> Source:
    from lmyard.tracking.lineage import lineage_run_id

    lineage = Run(run, _store(root))
    steps = catalog.complete_steps(lineage)
    if not steps:
        raise UserError(
            f"run {run!r} has no complete checkpoint in {redact_uri(lineage.uri(lineage.layout.checkpoints))}: "
            "train it first (lmyard run), or give another run"
        )
    if step is not None and step not in steps:
        raise UserError(f"run {run!r} has no complete checkpoint of step {step}; complete steps: {steps}")
    chosen = steps[-1] if step is None else step
    return Source(given, "checkpoint", root, run, chosen, mlflow_run_id=lineage_run_id(lineage))


def _export_info(folder: str, where: str) -> dict:
    try:
        with open(os.path.join(folder, "lmyard_export.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{where} is not a model lmyard exported (no readable lmyard_export.json)") from None


def _folder(given: str, step: int | None, store_uri: str) -> Source:
    if step is not None:
        raise UserError(f"{given} is an export folder of one step: drop --step")
    info = _export_info(given, given)
    return Source(given, "folder", store_uri, info.get("run_name"), info.get("step"), folder=given)


def _registered(given: str, step: int | None, store_uri: str, tracking_uri: str) -> Source:
    from lmyard.tracking.client import mlflow_client
    from lmyard.tracking.registered import model_version

    if step is not None:
        raise UserError(f"{given} is a registered version of one step: drop --step")
    version = model_version(mlflow_client(tracking_uri), given, tracking_uri, "model")
    return Source(given, "registered", store_uri, mlflow_run_id=version.run_id)


# ---------------------------------------------------------------- the model


@dataclass
class Loaded:
    model: Any  # lmyard.models.base.LanguageModel
    enc: Any  # the run's tokenizer
    step: int | None
    tokens_seen: int | None
    shard_address: str | None
    eval_config: dict  # the run's eval section, as it was recorded (empty for a folder)
    train_config: dict
    checkpoint: Any = None  # a checkpoint source's loaded Checkpoint (an lm-eval task exports it)


def load(src: Source, device: str, cache_dir: str, tracking_uri: str) -> Loaded:
    """The model of `src` on `device`, in eval mode, with its tokenizer and what it was trained on."""
    from lmyard.data.tokenizer import get_tokenizer
    from lmyard.export.hf import checkpoint_facts
    from lmyard.models.registry import model_from_checkpoint

    if src.kind == "checkpoint":
        assert src.store and src.run_name and src.step is not None
        run = Run(src.run_name, _store(src.store))
        ckpt = resume.load_complete(run, src.step, cache_dir, "give another step with --step", optimizer=False)
        facts, config = checkpoint_facts(ckpt), ckpt.state.config
        return Loaded(
            model_from_checkpoint(ckpt, device),
            get_tokenizer(facts.tokenizer),
            ckpt.step,
            ckpt.state.tokens_seen,
            ckpt.state.shard_address,
            config.get("eval") or {},
            config.get("train") or {},
            ckpt,
        )
    from lmyard.export.hf import init_from_hf
    from lmyard.models.registry import model_from_spec
    from lmyard.tracking.registered import export_folder

    if src.folder is None:  # a registered version: its export, downloaded
        src.folder = export_folder(src.given, tracking_uri, os.path.join(cache_dir, "registered"))
    info = _export_info(src.folder, src.given)
    state_dict, spec = init_from_hf(src.folder)
    model = model_from_spec(spec)
    model.load_state_dict(state_dict)
    src.run_name, src.step = info.get("run_name"), info.get("step")
    config = _run_config(src)
    return Loaded(
        model.to(device).eval(),
        get_tokenizer(TokenizerConfig.model_validate(info.get("tokenizer") or {})),
        info.get("step"),
        info.get("tokens_seen"),
        info.get("shard_address"),
        config.get("eval") or {},
        config.get("train") or {},
    )


def _run_config(src: Source) -> dict:
    """The config an export's checkpoint recorded, when its lineage is in the store (its val_tokens and
    micro_batch: the val loss the run logged); else {}, and the defaults."""
    if not (src.store and src.run_name and src.step is not None):
        return {}
    run = Run(src.run_name, _store(src.store))
    if src.step not in catalog.complete_steps(run):
        return {}
    return catalog.read_state(run, src.step).config


# ---------------------------------------------------------------- eval


def check_tasks(tasks: list[str], hellaswag: str | None) -> None:
    """Before any model is read: lmyard's measures need what they score, lm-eval's tasks must load offline."""
    from lmyard.evaluate import harness

    if "hellaswag" in tasks and not hellaswag:
        raise UserError("task hellaswag scores a HellaSwag-format JSONL: give --hellaswag FILE (ctx, endings, label)")
    others = [t for t in tasks if t not in BUILTIN]
    if others:
        try:
            harness.check_tasks(EvalConfig(harness_tasks=others, hellaswag=hellaswag))
        except UserError as e:  # the check speaks of a run's config; here the tasks are --tasks
            raise UserError(
                f"{e} (lmyard's own tasks: {', '.join(BUILTIN)})".replace("eval.harness_tasks", "--tasks")
            ) from None


def evaluate(src: Source, m: Loaded, tasks: list[str], hellaswag: str | None, device: str, cache_dir: str) -> dict:
    """The measures of `tasks` on the loaded model: {source, step, ..., metrics: {logged name: value}}."""
    from lmyard.evaluate import builtins, evals

    t0, metrics = time.perf_counter(), dict[str, float]()
    result: dict[str, Any] = {"source": src.given, "kind": src.kind, "run_name": src.run_name, "step": m.step}
    result["model"] = m.checkpoint.uri if m.checkpoint is not None else src.folder
    result["tokens_seen"], result["device"] = m.tokens_seen, device
    if "val_loss" in tasks:
        result["val_loss"], note = _val_loss(src, m, device, cache_dir)
        src.notes += [note] if note else []
        if result["val_loss"] is not None:
            metrics |= builtins.VAL_LOSS.metrics(evals.ValLoss(result["val_loss"]))
    if "hellaswag" in tasks and hellaswag:
        from lmyard.evaluate.hellaswag import read_hellaswag

        score = evals.hellaswag(m.model, m.enc, read_hellaswag(hellaswag), device)
        result["hellaswag"] = {"acc": score.acc, "acc_norm": score.acc_norm, "n": score.n}
        metrics |= builtins.HELLASWAG.metrics(score)
    others = [t for t in tasks if t not in BUILTIN]
    if others:
        result["harness"] = {"metrics": _harness(src, m, others, hellaswag, device)["metrics"]}
        metrics |= builtins.HARNESS.metrics(evals.HarnessScores(result["harness"]["metrics"]))
    result["metrics"] = metrics
    result["notes"], result["eval_s"] = src.notes, round(time.perf_counter() - t0, 3)
    return result


def _val_loss(src: Source, m: Loaded, device: str, cache_dir: str) -> tuple[float | None, str | None]:
    """The val loss on the shard set the model was trained on, or (None, why not)."""
    from lmyard.data.loader import split_stream, val_sequences
    from lmyard.data.shards import load_manifest
    from lmyard.evaluate.validation import val_loss

    if not (m.shard_address and src.store):
        return None, "val_loss: the model records no shard set"
    shards = load_manifest(_store(src.store), m.shard_address)
    if shards is None:
        return None, f"val_loss: shard set {m.shard_address[:12]} is not in {redact_uri(src.store)} (give --store)"
    tokens = int(m.eval_config.get("val_tokens") or EvalConfig().val_tokens)
    val = val_sequences(split_stream(shards, src.store, "val", cache_dir), m.model.config.block_size, tokens)
    return val_loss(m.model, val, int(m.train_config.get("micro_batch") or 4), device), None


def _harness(src: Source, m: Loaded, tasks: list[str], hellaswag: str | None, device: str) -> dict:
    from lmyard.evaluate import harness

    if src.folder:
        return harness.run(src.folder, tasks, hellaswag=hellaswag, device=device)
    from lmyard.export.hf import write_folder

    with tempfile.TemporaryDirectory(prefix="lmyard-eval-model-") as folder:
        write_folder(m.checkpoint, folder)
        return harness.run(folder, tasks, hellaswag=hellaswag, device=device)


def log(result: dict, src: Source, tracking_uri: str, experiment: str) -> str:
    """The metrics to the lineage's MLflow run (at the model's step, under lmyard_eval/), or to a new run of
    `experiment` when the lineage is not known; the run's id."""
    from lmyard.tracking.client import mlflow_client, tracking_errors

    client, run_id = mlflow_client(tracking_uri), src.mlflow_run_id
    fix = "give --tracking-uri (or LMYARD_TRACKING__URI) the MLflow server the lineage was recorded on"
    with tracking_errors(tracking_uri, f"the MLflow run {run_id or 'of a new evaluation'}", fix):
        return _log(client, result, src, experiment)


def _log(client, result: dict, src: Source, experiment: str) -> str:
    from mlflow.entities import Metric

    run_id, new = src.mlflow_run_id, src.mlflow_run_id is None
    if run_id is None:
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        tags = {"lmyard.eval_of": src.given, **({"lmyard.run_name": src.run_name} if src.run_name else {})}
        run_id = client.create_run(exp_id, run_name=f"eval-{src.run_name or 'model'}", tags=tags).info.run_id
    now, step = int(time.time() * 1000), int(result.get("step") or 0)
    metrics = [Metric(LOGGED_PREFIX + k, float(v), now, step) for k, v in result["metrics"].items()]
    client.log_batch(run_id, metrics=metrics)
    if new:
        client.set_terminated(run_id)
    return run_id
