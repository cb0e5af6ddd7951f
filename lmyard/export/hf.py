"""A checkpoint as a Hugging Face `transformers` model folder, and back.

    lmyard export STORE/runs/RUN[/checkpoints/step_NNNNNNNN] [--step N] --to DIR_OR_S3_URI

Design notes: docs/export.md, `lmyard/export/hf.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from lmyard.checkpoint import catalog, resume
from lmyard.checkpoint.state import Checkpoint
from lmyard.config import TokenizerConfig
from lmyard.errors import UserError
from lmyard.layout import RunLayout
from lmyard.models import registry
from lmyard.models.spec import HFAdapter
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking.registered import export_folder, is_registered

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class CheckpointFacts:
    """What an export needs to know about a checkpoint besides its weights."""

    architecture: str  # the model family (model.arch): a key of lmyard.models.registry.FAMILIES
    dims: dict  # the model config's fields (GPTConfig, LlamaConfig)
    tokenizer: TokenizerConfig
    generation: dict  # sampling defaults (temperature, top_k) from the run's eval config
    provenance: dict  # step, tokens seen, shard address, run name


def checkpoint_facts(ckpt: Checkpoint) -> CheckpointFacts:
    """The one place that reads a checkpoint's state (state.json, lmyard.checkpoint.schema.CheckpointState)."""
    state = ckpt.state
    config, spec = state.config, dict(state.model)
    eval_cfg = config.get("eval") or {}
    return CheckpointFacts(
        architecture=spec.pop("arch", registry.DEFAULT),  # registry.model_spec; checkpoints before Llama: GPT-2
        dims=spec,
        tokenizer=TokenizerConfig.model_validate(config.get("tokenizer") or {}),
        generation={"temperature": eval_cfg.get("temperature", 0.8), "top_k": eval_cfg.get("top_k", 40)},
        provenance={
            "checkpoint": ckpt.uri,
            "step": ckpt.step,
            "tokens_seen": state.tokens_seen,
            "shard_address": state.shard_address,
            "run_name": config.get("run_name"),
        },
    )


def adapter_for(architecture: str, where: str) -> HFAdapter:
    """The Hugging Face mapping of the family `architecture` (lmyard.models.registry); UserError if none."""
    try:
        return registry.spec(architecture).hf
    except KeyError:
        raise UserError(
            f"{where} has architecture {architecture!r}, which lmyard cannot export: "
            f"known architectures are {', '.join(sorted(registry.FAMILIES))}"
        ) from None


# ---------------------------------------------------------------- reading a checkpoint


def parse_source(uri: str, step: int | None) -> tuple[str, str, int | None]:
    """(store root, run name, step or None for the newest) of STORE/runs/RUN[/checkpoints/step_NNNNNNNN]."""
    located = RunLayout.locate(uri)
    if located is None:
        raise UserError(
            f"{uri!r} is not a run or a checkpoint: give STORE/runs/RUN (the newest checkpoint, or "
            "--step N) or STORE/runs/RUN/checkpoints/step_NNNNNNNN"
        )
    root, run, in_uri = located
    if in_uri is not None and step is not None and in_uri != step:
        raise UserError(f"{uri} is the checkpoint of step {in_uri} but --step says {step}: give one of them")
    return root, run, in_uri if in_uri is not None else step


def load_checkpoint(uri: str, step: int | None, cache_dir: str) -> Checkpoint:
    """The complete checkpoint named by `uri` (and `step`); a missing, incomplete or damaged one is a UserError."""
    root, name, step = parse_source(uri, step)
    run = Run(name, open_store(root))
    steps = catalog.complete_steps(run)
    if step is None and not steps:
        raise UserError(f"{run.uri(run.layout.checkpoints)} holds no complete checkpoint (one with its manifest.json)")
    step = steps[-1] if step is None else step
    where = run.uri(run.layout.step(step))
    if step not in steps:
        started = run.store.list(run.layout.step(step))
        state = "is incomplete (no manifest.json)" if started else "does not exist"
        raise UserError(f"checkpoint {where} {state}; complete steps: {steps or 'none'}")
    return resume.load_complete(run, step, cache_dir, "export another step with --step")


# ---------------------------------------------------------------- writing the folder


def write_folder(ckpt: Checkpoint, folder: str) -> dict:
    """The Hugging Face folder of `ckpt` in the (existing, empty) local `folder`; returns lmyard_export.json."""
    from safetensors.torch import save_file

    from lmyard.data.hf_tokenizer import write_tokenizer
    from lmyard.data.tokenizer import get_tokenizer

    facts = checkpoint_facts(ckpt)
    adapter = adapter_for(facts.architecture, f"checkpoint {ckpt.uri}")
    enc = get_tokenizer(facts.tokenizer)
    model = registry.model_from_checkpoint(ckpt, "cpu")
    dims = {**facts.dims, **dataclasses.asdict(model.config)}
    config = adapter.config(dims, enc.eot_token)
    save_file(adapter.to_hf(model.state_dict(), dims), os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    # sampling never picks the embedding's padding rows (ids past the tokenizer's vocabulary)
    generation = {
        "bos_token_id": enc.eot_token,
        "eos_token_id": enc.eot_token,
        "do_sample": True,
        # a length in new tokens, as the pyfunc's (lmyard/export/pyfunc.py) own: with both kinds set, generate warns
        "max_new_tokens": dims["block_size"] // 2,
        **{k: v for k, v in facts.generation.items() if v is not None},
        "suppress_tokens": list(range(enc.n_vocab, dims["vocab_size"])) or None,
    }
    write_tokenizer(enc, folder, model_max_length=dims["block_size"])
    info = {
        "format": "lmyard-hf-export/1",
        "architecture": facts.architecture,
        "hf_architecture": adapter.architecture,
        "tokenizer": facts.tokenizer.model_dump(),
        **facts.provenance,
    }
    if dims.get("doc_bos") is not None or dims.get("doc_eos") is not None:
        info["doc_mask"] = True  # trained block-causal over packed documents; HF's model attends causally
    for name, data in (("config.json", config), ("generation_config.json", generation), ("lmyard_export.json", info)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=1)
    return info


def _umask() -> int:
    umask = os.umask(0o022)  # read it by setting it (the process's only interface), then put it back
    os.umask(umask)
    return umask


def readable_by_all(folder: str) -> None:
    """The modes a folder made by `lmyard export` should have had: 0755 for folders, 0644 for files, under the
    umask. mkdtemp makes its folder 0700 (and safetensors its file 0600), which no serving or evaluating user
    but the exporter could read."""
    umask = _umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def check_destination(dest: str) -> None:
    """A destination must not exist, or be an empty folder (prefix): an export never mixes with other files."""
    if dest.startswith("s3://"):
        if open_store(dest).list(""):
            raise UserError(f"destination {dest} is not empty: choose a new prefix or delete what is there")
    elif os.path.isfile(dest) or (os.path.isdir(dest) and os.listdir(dest)):
        raise UserError(f"destination {dest} exists and is not empty: choose a new folder or delete it")


def publish(folder: str, dest: str) -> str:
    """Move (local) or upload (S3) a finished folder to `dest`; on S3 config.json goes last, and a failed
    upload removes what it wrote. Returns the destination's URI."""
    if not dest.startswith("s3://"):
        dest = os.path.abspath(dest)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty (checked)
        try:
            os.replace(folder, dest)
        except OSError:  # another filesystem
            shutil.copytree(folder, dest + ".partial")
            os.replace(dest + ".partial", dest)
        return dest
    store = open_store(dest)
    names = sorted(os.listdir(folder), key=lambda n: n == "config.json")
    try:
        for name in names:
            store.upload(os.path.join(folder, name), name)
    except BaseException:
        store.delete("")
        raise
    return store.uri("").rstrip("/")


def _staging_beside(dest: str) -> str:
    """A new temporary folder beside a local `dest` (the final move is a rename), or in the system's temporary
    folder for S3. A parent this user cannot write is a UserError that names it."""
    parent = os.path.dirname(os.path.abspath(dest)) if not dest.startswith("s3://") else None
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=".lmyard-export-", dir=parent)
    except OSError as e:
        where = f"destination {dest}: cannot write in {parent}" if parent else "the temporary folder"
        raise UserError(
            f"{where} ({e.strerror or type(e).__name__}): choose --to a folder this user can write, or fix its "
            "permissions"
        ) from None


def export(source: str, dest: str, step: int | None = None, cache_dir: str | None = None) -> dict:
    """Export the checkpoint `source` (STORE/runs/RUN[/checkpoints/step_N], `step`) to the folder or S3 prefix
    `dest`; returns lmyard_export.json's content and the destination's URI."""
    from lmyard.data.loader import default_cache_dir

    check_destination(dest)
    cache = cache_dir or default_cache_dir()
    tmp = _staging_beside(dest)  # before the checkpoint is read: a destination this user cannot write stops here
    try:
        ckpt = load_checkpoint(source, step, os.path.join(cache, "export"))
        info = write_folder(ckpt, tmp)
        readable_by_all(tmp)
        return {**info, "uri": publish(tmp, dest)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- reading a folder (model.init_from)


def _local_folder(path: str, cache_dir: str | None, tracking_uri: str | None = None) -> str:
    if is_registered(path):  # models:/NAME/VERSION: the export that version was logged from
        from lmyard.data.loader import default_cache_dir

        if not tracking_uri:
            raise UserError(f"model.init_from {path}: a registered model is looked up through tracking.uri; set it")
        return export_folder(path, tracking_uri, os.path.join(cache_dir or default_cache_dir(), "init_from"))
    if not path.startswith("s3://"):
        if not os.path.isdir(path):
            raise UserError(f"model.init_from {path!r} is not a folder: give a Hugging Face model folder")
        return path
    from lmyard.data.loader import default_cache_dir

    store = open_store(path)
    local = os.path.join(cache_dir or default_cache_dir(), "init_from", re.sub(r"[^A-Za-z0-9._-]", "_", path))
    for key in store.list(""):
        if "/" not in key:
            store.download(key, os.path.join(local, key))
    return local


def init_from_hf(path: str, cache_dir: str | None = None, tracking_uri: str | None = None) -> tuple[dict, dict]:
    """(state_dict, model spec) from a Hugging Face model folder (local, s3://, or a registered model version
    models:/NAME/VERSION or models:/NAME@ALIAS through `tracking_uri`): build the model with
    `lmyard.models.registry.model_from_spec(spec)` and load the state_dict into it."""
    from safetensors.torch import load_file

    folder = _local_folder(path, cache_dir, tracking_uri)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"model.init_from {path}: no readable config.json; give a Hugging Face model folder") from None
    archs = config.get("architectures") or []
    by_hf = {s.hf.architecture: s.hf for s in registry.FAMILIES.values()}
    adapter = next((by_hf[a] for a in archs if a in by_hf), None)
    if adapter is None:
        raise UserError(
            f"model.init_from {path}: architecture {archs or config.get('model_type')} is not one "
            f"lmyard can load; known: {', '.join(sorted(by_hf))}"
        )
    weights = os.path.join(folder, WEIGHTS)
    if not os.path.exists(weights):
        raise UserError(
            f"model.init_from {path}: no {WEIGHTS} (sharded or .bin weights are not supported); "
            "save it with save_pretrained(safe_serialization=True, max_shard_size='100GB')"
        )
    try:
        return adapter.from_hf(load_file(weights), config)
    except KeyError as e:
        raise UserError(f"model.init_from {path}: {WEIGHTS} lacks tensor {e} for its config") from None
