"""A checkpoint as a Hugging Face `transformers` model folder, and back.

    lmyard export STORE/runs/RUN[/checkpoints/step_NNNNNNNN] [--step N] --to DIR_OR_S3_URI

The folder holds config.json, model.safetensors, generation_config.json, the
run's tokenizer (tokenizer.json built offline from its ranks, see
lmyard.hf_tokenizer) and lmyard_export.json (where it came from). Exporters
are registered by lmyard architecture (`EXPORTERS`, keyed by `model.arch`):
GPT-2 becomes `GPT2LMHeadModel`, Llama `LlamaForCausalLM`; another family adds
an `Exporter` under its name.

The folder is written to a temporary folder first and moved (local) or
uploaded (S3, config.json last) at the end, so a destination never holds half
an export; `init_from_hf` reads such a folder back into lmyard's GPT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from lmyard.checkpoint import full as checkpoint
from lmyard.config import TokenizerConfig
from lmyard.errors import UserError
from lmyard.store import open_store

WEIGHTS = "model.safetensors"
_URI = re.compile(
    r"^(?P<root>.+?)/runs/(?P<run>[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:/checkpoints(?:/step_(?P<step>\d{8}))?)?/?$"
)


@dataclass(frozen=True)
class CheckpointFacts:
    """What an export needs to know about a checkpoint besides its weights."""

    architecture: str  # lmyard's architecture (model.arch): a key of EXPORTERS
    dims: dict  # the model config's fields (GPTConfig, LlamaConfig)
    tokenizer: TokenizerConfig
    generation: dict  # sampling defaults (temperature, top_k) from the run's eval config
    provenance: dict  # step, tokens seen, shard address, run name


def checkpoint_facts(ckpt: checkpoint.Checkpoint) -> CheckpointFacts:
    """The one place that reads a checkpoint's state (state.json, lmyard.contracts.CheckpointState)."""
    state = ckpt.state
    config, spec = state.config, dict(state.model)
    eval_cfg = config.get("eval") or {}
    return CheckpointFacts(
        architecture=spec.pop("arch", "gpt2"),  # lmyard.models.model_spec; checkpoints before Llama: GPT-2
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


# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Exporter:
    """One model family's mapping to and from a Hugging Face architecture."""

    hf_architecture: str  # e.g. GPT2LMHeadModel
    hf_config: Callable[[dict, int], dict]  # (dims, eot id) -> config.json
    to_hf: Callable[[dict, dict], dict]  # (lmyard state_dict, dims) -> HF tensors
    from_hf: Callable[[dict, dict], tuple[dict, dict]]  # (HF tensors, config.json) -> (state_dict, dims)


def _gpt2_config(dims: dict, eot: int) -> dict:
    p = dims.get("dropout", 0.0)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": dims["vocab_size"],
        "n_positions": dims["block_size"],
        "n_ctx": dims["block_size"],
        "n_embd": dims["n_embd"],
        "n_layer": dims["n_layer"],
        "n_head": dims["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new",  # tanh-approximated GELU, as lmyard.model.MLP
        "resid_pdrop": p,
        "embd_pdrop": p,
        "attn_pdrop": p,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


# Conv1D in HF GPT-2 stores (in, out): the transpose of nn.Linear's (out, in)
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_GPT2_BIASED = ("ln_1", "ln_2", *_GPT2_CONV1D)


def _gpt2_to_hf(sd: dict, dims: dict) -> dict:
    import torch

    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
    }
    out["transformer.ln_f.bias"] = sd.get("ln_f.bias", torch.zeros_like(sd["ln_f.weight"]))
    for i in range(dims["n_layer"]):
        for name in _GPT2_BIASED:
            w = sd[f"h.{i}.{name}.weight"]
            out[f"transformer.h.{i}.{name}.weight"] = w.t() if name in _GPT2_CONV1D else w
            # a model without biases (model.bias=false) exports zero biases: the same function
            out[f"transformer.h.{i}.{name}.bias"] = sd.get(f"h.{i}.{name}.bias", torch.zeros(w.shape[0], dtype=w.dtype))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}  # lm_head is tied to wte: not saved


def _gpt2_from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(
            f"GPT-2 folder uses activation {config['activation_function']!r}; lmyard's GPT uses "
            "the tanh GELU (gelu_new)"
        )
    if config.get("n_inner") not in (None, 4 * config["n_embd"]) or not config.get("tie_word_embeddings", True):
        raise UserError("GPT-2 folder has a non-standard MLP width or untied head; lmyard's GPT cannot hold it")
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""  # the original gpt2 files have none
    dims = {
        "arch": "gpt2",
        "vocab_size": config["vocab_size"],
        "block_size": config["n_positions"],
        "n_layer": config["n_layer"],
        "n_head": config["n_head"],
        "n_embd": config["n_embd"],
        "dropout": 0.0,
        "bias": True,
    }
    sd = {
        "wte.weight": tensors[f"{prefix}wte.weight"],
        "wpe.weight": tensors[f"{prefix}wpe.weight"],
        "ln_f.weight": tensors[f"{prefix}ln_f.weight"],
        "ln_f.bias": tensors[f"{prefix}ln_f.bias"],
    }
    for i in range(config["n_layer"]):
        for name in _GPT2_BIASED:
            w = tensors[f"{prefix}h.{i}.{name}.weight"]
            sd[f"h.{i}.{name}.weight"] = w.t().contiguous() if name in _GPT2_CONV1D else w
            sd[f"h.{i}.{name}.bias"] = tensors[f"{prefix}h.{i}.{name}.bias"]
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd, dims


def _llama_config(dims: dict, eot: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims["vocab_size"],
        "hidden_size": dims["n_embd"],
        "intermediate_size": dims["ffn_hidden"],
        "num_hidden_layers": dims["n_layer"],
        "num_attention_heads": dims["n_head"],
        "num_key_value_heads": dims["n_kv_head"],
        "head_dim": dims["n_embd"] // dims["n_head"],
        "max_position_embeddings": dims["block_size"],
        "rms_norm_eps": dims["norm_eps"],
        "rope_theta": dims["rope_theta"],  # transformers 4; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": dims["rope_theta"]},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def _llama_sizes(dims: dict) -> list[int]:
    head = dims["n_embd"] // dims["n_head"]
    return [dims["n_head"] * head, dims["n_kv_head"] * head, dims["n_kv_head"] * head]


def _llama_to_hf(sd: dict, dims: dict) -> dict:
    """lmyard's Llama names are HF's without `model.`, but for q, k and v fused in qkv_proj (stacked by rows)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            base = "model." + k.removesuffix("qkv_proj.weight")
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.split(_llama_sizes(dims), dim=0)):
                out[f"{base}{name}.weight"] = part
        else:
            out[k if k.startswith("lm_head.") else f"model.{k}"] = v
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def _llama_from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
    import torch

    if config.get("tie_word_embeddings") or config.get("attention_bias") or config.get("mlp_bias"):
        raise UserError("Llama folder has tied embeddings or biases; lmyard's Llama has neither")
    dims = {
        "arch": "llama",
        "vocab_size": config["vocab_size"],
        "block_size": config["max_position_embeddings"],
        "n_layer": config["num_hidden_layers"],
        "n_head": config["num_attention_heads"],
        "n_embd": config["hidden_size"],
        "n_kv_head": config.get("num_key_value_heads") or config["num_attention_heads"],
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0),
    }
    sd = {}
    for k, v in tensors.items():
        name = k.removeprefix("model.")
        if name.endswith("self_attn.q_proj.weight"):
            base = name.removesuffix("q_proj.weight")
            sd[f"{base}qkv_proj.weight"] = torch.cat(
                [v, tensors[f"model.{base}k_proj.weight"], tensors[f"model.{base}v_proj.weight"]]
            )
        elif not name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            sd[name] = v
    return sd, dims


EXPORTERS: dict[str, Exporter] = {
    "gpt2": Exporter("GPT2LMHeadModel", _gpt2_config, _gpt2_to_hf, _gpt2_from_hf),
    "llama": Exporter("LlamaForCausalLM", _llama_config, _llama_to_hf, _llama_from_hf),
}


def exporter_for(architecture: str, where: str) -> Exporter:
    try:
        return EXPORTERS[architecture]
    except KeyError:
        raise UserError(
            f"{where} has architecture {architecture!r}, which lmyard cannot export: "
            f"known architectures are {', '.join(sorted(EXPORTERS))}"
        ) from None


# ---------------------------------------------------------------- reading a checkpoint


def parse_source(uri: str, step: int | None) -> tuple[str, str, int | None]:
    """(store root, run name, step or None for the newest) of STORE/runs/RUN[/checkpoints/step_NNNNNNNN]."""
    m = _URI.match(uri.rstrip("/"))
    if not m:
        raise UserError(
            f"{uri!r} is not a run or a checkpoint: give STORE/runs/RUN (the newest checkpoint, or "
            "--step N) or STORE/runs/RUN/checkpoints/step_NNNNNNNN"
        )
    in_uri = int(m["step"]) if m["step"] else None
    if in_uri is not None and step is not None and in_uri != step:
        raise UserError(f"{uri} is the checkpoint of step {in_uri} but --step says {step}: give one of them")
    return m["root"], m["run"], in_uri if in_uri is not None else step


def load_checkpoint(uri: str, step: int | None, cache_dir: str) -> checkpoint.Checkpoint:
    """The complete checkpoint named by `uri` (and `step`); a missing, incomplete or damaged one is a UserError."""
    import pickle

    root, run, step = parse_source(uri, step)
    store = open_store(root)
    steps = checkpoint.complete_steps(store, run)
    if step is None and not steps:
        raise UserError(
            f"{store.uri(checkpoint.checkpoints_prefix(run))} holds no complete checkpoint (one with its manifest.json)"
        )
    step = steps[-1] if step is None else step
    where = store.uri(checkpoint.step_prefix(run, step))
    if step not in steps:
        started = store.list(checkpoint.step_prefix(run, step))
        state = "is incomplete (no manifest.json)" if started else "does not exist"
        raise UserError(f"checkpoint {where} {state}; complete steps: {steps or 'none'}")
    try:
        return checkpoint.load_step(store, run, step, cache_dir)
    except (ValueError, OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(
            f"checkpoint {where} is damaged ({str(e).splitlines()[0]}); export another step with "
            f"--step (complete steps: {steps})"
        ) from None


# ---------------------------------------------------------------- writing the folder


def write_folder(ckpt: checkpoint.Checkpoint, folder: str) -> dict:
    """The Hugging Face folder of `ckpt` in the (existing, empty) local `folder`; returns lmyard_export.json."""
    from safetensors.torch import save_file

    from lmyard.data.hf_tokenizer import write_tokenizer
    from lmyard.data.tokenizer import get_tokenizer
    from lmyard.evaluate.evals import load_model

    facts = checkpoint_facts(ckpt)
    exporter = exporter_for(facts.architecture, f"checkpoint {ckpt.uri}")
    enc = get_tokenizer(facts.tokenizer)
    model = load_model(ckpt, "cpu")
    dims = {**facts.dims, **dataclasses.asdict(model.config)}
    config = exporter.hf_config(dims, enc.eot_token)
    save_file(exporter.to_hf(model.state_dict(), dims), os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    # sampling never picks the embedding's padding rows (ids past the tokenizer's vocabulary)
    generation = {
        "bos_token_id": enc.eot_token,
        "eos_token_id": enc.eot_token,
        "do_sample": True,
        "max_length": dims["block_size"],
        **{k: v for k, v in facts.generation.items() if v is not None},
        "suppress_tokens": list(range(enc.n_vocab, dims["vocab_size"])) or None,
    }
    write_tokenizer(enc, folder, model_max_length=dims["block_size"])
    info = {
        "format": "lmyard-hf-export/1",
        "architecture": facts.architecture,
        "hf_architecture": exporter.hf_architecture,
        "tokenizer": facts.tokenizer.model_dump(),
        **facts.provenance,
    }
    for name, data in (("config.json", config), ("generation_config.json", generation), ("lmyard_export.json", info)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=1)
    return info


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


def export(source: str, dest: str, step: int | None = None, cache_dir: str | None = None) -> dict:
    """Export the checkpoint `source` (STORE/runs/RUN[/checkpoints/step_N], `step`) to the folder or S3 prefix
    `dest`; returns lmyard_export.json's content and the destination's URI."""
    from lmyard.data.loader import default_cache_dir

    check_destination(dest)
    cache = cache_dir or default_cache_dir()
    ckpt = load_checkpoint(source, step, os.path.join(cache, "export"))
    parent = os.path.dirname(os.path.abspath(dest)) if not dest.startswith("s3://") else None
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".lmyard-export-", dir=parent)  # beside dest: the final move is a rename
    try:
        info = write_folder(ckpt, tmp)
        return {**info, "uri": publish(tmp, dest)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- reading a folder (model.init_from)


def _local_folder(path: str, cache_dir: str | None) -> str:
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


def init_from_hf(path: str, cache_dir: str | None = None) -> tuple[dict, dict]:
    """(state_dict, model spec) from a Hugging Face model folder (local or s3://): build the model with
    `lmyard.models.model_from_spec(spec)` and load the state_dict into it."""
    from safetensors.torch import load_file

    folder = _local_folder(path, cache_dir)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"model.init_from {path}: no readable config.json; give a Hugging Face model folder") from None
    archs = config.get("architectures") or []
    by_hf = {e.hf_architecture: e for e in EXPORTERS.values()}
    exporter = next((by_hf[a] for a in archs if a in by_hf), None)
    if exporter is None:
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
        return exporter.from_hf(load_file(weights), config)
    except KeyError as e:
        raise UserError(f"model.init_from {path}: {WEIGHTS} lacks tensor {e} for its config") from None
