"""What a model family is, as torchtitan's ModelSpec: one frozen record per family, in its own package.

A family (lmyard/models/gpt2, lmyard/models/llama) is a package: `__init__.py` holds its `SPEC` (presets,
the resolution of `model.*` into its config's fields, its checks, its Hugging Face mapping both ways, its
parameter and activation terms, its FSDP units) and imports no torch, so the config can ask the registry
in the flow's process; `model.py` holds its nn.Module and config dataclass, imported by `build` only when
a model is made. lmyard.models.registry maps `model.arch` to the spec; the trainer, the evaluator, export
and memory planning ask it and never name a family.

A family's config (GPTConfig, LlamaConfig) is a frozen dataclass whose fields are the family's
`resolve` dict; `lmyard.models.registry.model_spec` records them (with `arch`) in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class HFAdapter:
    """A family's mapping to and from one Hugging Face `transformers` architecture."""

    architecture: str
    """HF's class name in config.json's `architectures`, e.g. GPT2LMHeadModel."""
    config: Callable[[dict, int], dict]
    """(config fields, end-of-text id) -> HF's config.json."""
    to_hf: Callable[[dict, dict], dict]
    """(lmyard state_dict, config fields) -> HF's tensors (CPU, contiguous)."""
    from_hf: Callable[[dict, dict], tuple[dict, dict]]
    """(HF's tensors, config.json) -> (lmyard state_dict, config fields with `arch`); UserError if it cannot hold it."""


@dataclass(frozen=True, kw_only=True)
class Terms:
    """Parameter counts and per-token activation bytes of a configured model, for memory planning and FLOPs."""

    block: int
    """Parameters of one block."""
    root: int
    """Parameters outside the blocks (embeddings, positions, final norm, an untied head)."""
    lookup: int
    """Parameters used by lookup, not matmul (an untied input embedding): no FLOPs (torchtitan's count)."""
    activations: dict[str, int]
    """Bytes kept for backward per token and block, by train.activation_checkpointing (none, pointwise,
    selective, full)."""
    compiled: dict[str, int] = field(default_factory=dict)
    """The same under torch.compile, for the modes where it keeps fewer (inductor recomputes pointwise ops in
    backward from what it keeps); a mode not here keeps `activations`' figure."""


@dataclass(frozen=True, kw_only=True)
class Scaling:
    """How one recipe makes a family of sizes (lmyard.models.registry.scaled): each of `scaled` is its base value
    (the config's, else the preset's) times the scaling index; `fixed` stay as the recipe sets them. Widths that
    follow the model width (an MLP's) grow with it."""

    scaled: tuple[str, ...]
    """`model.*` fields multiplied by the index (width, heads)."""
    fixed: tuple[str, ...]
    """`model.*` fields every size keeps (depth, context, the width rules)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    """`model.arch`, and the `arch` a checkpoint records."""
    summary: str
    """What sets it apart, for `model.arch`'s description."""
    presets: dict[str, dict]
    """Preset name -> `model.*` fields it sets (a preset set by the user implies this family)."""
    fields: tuple[str, ...]
    """`model.*` fields only this family reads: set for another family, they are refused."""
    resolve: Callable[[Any, int], dict]
    """(lmyard.config.ModelConfig, the tokenizer's n_vocab) -> the config dataclass's fields."""
    check: Callable[[Any], None]
    """(ModelConfig) -> None; ValueError naming the field for a shape this family cannot build."""
    build: Callable[[dict], Any]
    """Config fields -> a fresh nn.Module (on the default device); imports torch."""
    config: Callable[[dict], Any]
    """Config fields -> the family's config dataclass; imports torch (it lives beside the module)."""
    hf: HFAdapter
    terms: Callable[[dict], Terms]
    """Config fields -> parameter counts and activation bytes (lmyard.train.distributed.memory, FLOPs)."""
    scaling: Scaling = field(
        default_factory=lambda: Scaling(scaled=("n_embd", "n_head"), fixed=("n_layer", "block_size"))
    )
    """The fields a size sweep scales by its index, and those it keeps."""
    fsdp_units: Callable[[Any], list[tuple[list, bool]]] = field(default=lambda model: [])
    """Modules sharded as units of their own before the blocks, with whether they reshard after forward
    (lmyard.train.distributed.parallel.apply_fsdp); what is left goes to the root unit."""
