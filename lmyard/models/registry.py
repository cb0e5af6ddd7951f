"""The model families by `model.arch`, and the one place a model is made.

    FAMILIES: gpt2 (lmyard.models.gpt2), llama (lmyard.models.llama)

A new family is a package beside those two (its `SPEC`, lmyard.models.spec.ModelSpec, and its
nn.Module) and one line below. Everything else asks this module: the config (presets, `model.arch`, the
family's checks), the trainer (`build_model`, FSDP units), the evaluator and export (`model_from_checkpoint`,
the Hugging Face mapping), memory planning (`terms`) and MFU (`flops_per_token`).

Importing it loads no torch (the config validates with it in the flow's process); making a model does.
`model_spec`/`model_from_spec` carry a model's family and shape through a checkpoint's state.json.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lmyard.errors import UserError
from lmyard.models import gpt2, llama
from lmyard.models.spec import ModelSpec

if TYPE_CHECKING:  # importing this module loads no torch
    from lmyard.models.base import LanguageModel

FAMILIES: dict[str, ModelSpec] = {s.name: s for s in (gpt2.SPEC, llama.SPEC)}
DEFAULT = "gpt2"  # free-form sizes without model.arch, and checkpoints written before Llama (no `arch`)


def spec(arch: str) -> ModelSpec:
    """The family named `arch`; KeyError for an unknown one."""
    return FAMILIES[arch]


def spec_of(model) -> ModelSpec:
    """The family of a model made here (its class's `family`)."""
    return FAMILIES[model.family]


def presets() -> dict[str, dict]:
    """Every family's presets, each with its `arch`."""
    return {name: {"arch": s.name, **fields} for s in FAMILIES.values() for name, fields in s.presets.items()}


def check(cfg) -> None:
    """The family-specific checks of `model.*` (lmyard.config.ModelConfig): another family's fields are
    refused, then the family's own; ValueError naming the field."""
    arch = cfg.architecture()
    for other in FAMILIES.values():
        given = [f for f in other.fields if f not in FAMILIES[arch].fields and getattr(cfg, f) is not None]
        if given:
            raise ValueError(
                f"model.{', model.'.join(given)} apply to {other.name} models only; set model.arch={other.name}"
            )
    FAMILIES[arch].check(cfg)


def scaled(cfg, index: int) -> dict[str, int]:
    """The `model.*` fields of size `index` of the configured model (lmyard.config.ModelConfig): each of its
    family's scaling fields (spec.scaling.scaled) is its base value times `index`, the rest as configured; index 1 is
    the configuration itself. A field with no base value (Llama's n_kv_head unset: n_head's) is left to follow."""
    family = FAMILIES[cfg.architecture()]
    base = {**family.presets.get(cfg.preset or "", {}), **cfg.dims()}
    out = {}
    for name in family.scaling.scaled:
        value = getattr(cfg, name, None)
        value = value if value is not None else base.get(name)
        if value is not None:
            out[name] = int(value) * index
    return out


def resolve(cfg, n_vocab: int) -> dict:
    """The configured model's config fields (`model.*` resolved by its family), JSON-able; no torch."""
    return FAMILIES[cfg.architecture()].resolve(cfg, n_vocab)


def model_config(cfg, n_vocab: int):
    """The resolved shape of the configured family (GPTConfig, LlamaConfig); vocab defaults to n_vocab rounded
    up to 64."""
    return FAMILIES[cfg.architecture()].config(resolve(cfg, n_vocab))


def doc_fields(cfg, separators: tuple[int | None, int | None]) -> dict:
    """The config fields of `model.doc_mask` (every family's `doc_bos`, `doc_eos`: lmyard.models.attention):
    the ids written before and after each packed document (the shard set's, lmyard.data.shards.ShardSet
    .separators); {} when it is off. UserError when documents are not separated at all."""
    if not cfg.doc_mask:
        return {}
    bos, eos = separators
    if bos is None and eos is None:
        raise UserError(
            "model.doc_mask needs documents separated by a token, but the shard set has none; "
            "set tokenizer.bos or tokenizer.eos, or model.doc_mask=false"
        )
    return {"doc_bos": bos, "doc_eos": eos}


def build_model(cfg, n_vocab: int, separators: tuple[int | None, int | None] = (None, None)) -> LanguageModel:
    """A freshly initialised model of `model.*` (on the current default device: build under
    `with torch.device(...)` to make the weights there); `separators`: the shard set's (doc_fields)."""
    return FAMILIES[cfg.architecture()].build({**resolve(cfg, n_vocab), **doc_fields(cfg, separators)})


def model_spec(model) -> dict:
    """The family and its config fields, JSON-able: what a checkpoint records to rebuild the model."""
    return {"arch": model.family, **dataclasses.asdict(model.config)}


def model_from_spec(fields: dict) -> LanguageModel:
    """The model of `model_spec`'s dict (without `arch`: a GPT-2, as checkpoints written before Llama say)."""
    fields = dict(fields)
    return FAMILIES[fields.pop("arch", DEFAULT)].build(fields)


def model_from_checkpoint(ckpt, device: str = "cpu"):
    """The model of a loaded checkpoint (lmyard.checkpoint's Checkpoint: `state.model`, the spec, and `model`,
    the state_dict), on `device`, in eval mode: what the evaluator and export score and convert."""
    model = model_from_spec(ckpt.state.model)
    model.load_state_dict(ckpt.model)
    return model.to(device).eval()


def parameters(fields: dict) -> int:
    """Parameters of the model of `model_spec`'s dict (or `resolve`'s with `arch`), from its family's terms."""
    fields = dict(fields)
    t = FAMILIES[fields.pop("arch", DEFAULT)].terms(fields)
    return fields["n_layer"] * t.block + t.root


def flops_per_token(fields: dict) -> int:
    """Training FLOPs per token of the model of `model_spec`'s dict: 6 * (parameters - lookup tables) +
    12 * L * d * T (PaLM appendix B; torchtitan's get_dense_model_nparams_and_flops). 6N': each weight of a
    matmul (the head included) costs 2 FLOPs forward and 4 backward; 12*L*d*T: the two attention matmuls
    (scores, weighted values) at 2 FLOPs per multiply-add, x3 for forward + backward, causal masking not
    discounted."""
    fields = dict(fields)
    t = FAMILIES[fields.pop("arch", DEFAULT)].terms(fields)
    L, d, T = fields["n_layer"], fields["n_embd"], fields["block_size"]
    return 6 * (L * t.block + t.root - t.lookup) + 12 * L * d * T
