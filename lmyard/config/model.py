"""The `model` section: a family's preset and its fields, resolved through lmyard.models.registry."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmyard.config.base import _Section
from lmyard.models import registry  # torch-free: presets and checks of each model family


class ModelConfig(_Section):
    preset: str | None = Field("tiny", description=f"One of {sorted(registry.presets())}, or null for free-form sizes.")
    arch: Literal[tuple(registry.FAMILIES)] | None = Field(  # type: ignore[valid-type]  # the registered families
        None,
        description=" or ".join(f"`{name}` ({s.summary})" for name, s in registry.FAMILIES.items())
        + f"; default: the preset's, {registry.DEFAULT} for free sizes.",
    )
    n_layer: int | None = Field(None, gt=0, description="Transformer blocks (overrides the preset).")
    n_head: int | None = Field(None, gt=0, description="Attention heads (overrides the preset).")
    n_embd: int | None = Field(None, gt=0, description="Model width (overrides the preset).")
    block_size: int | None = Field(None, gt=0, description="Context length in tokens (overrides the preset).")
    vocab_size: int | None = Field(
        None,
        gt=0,
        description="Embedding rows; default: the preset's (128256 for llama-1b/3b/8b), else the "
        "tokenizer's vocabulary rounded up to 64.",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="GPT-2 only.")
    bias: bool = Field(True, description="GPT-2 only (Llama has no biases).")
    n_kv_head: int | None = Field(
        None, gt=0, description="Llama: key/value heads (grouped-query attention); default: the preset's, else n_head."
    )
    ffn_dim_multiplier: float | None = Field(
        None,
        gt=0,
        description="Llama: SwiGLU width = multiple_of-rounded multiplier * 8d/3; default: the preset's, else 1.",
    )
    multiple_of: int | None = Field(
        None, gt=0, description="Llama: SwiGLU width rounded up to a multiple of this; default: the preset's, else 256."
    )
    rope_theta: float | None = Field(None, gt=0, description="Llama: RoPE base; default 500000 (Llama 3).")
    norm_eps: float | None = Field(None, gt=0, description="Llama: RMSNorm epsilon; default 1e-5.")
    attention: Literal["auto", "fa4", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description="SDPA kernel: `auto` lets PyTorch choose (cuDNN's on Hopper GPUs); `fa4` runs "
        "FlashAttention-4's kernels (Hopper or Blackwell GPUs, `pip install 'lmyard[fa4]'`; lmyard.models.ops.flash4), "
        "the fastest measured on H200.",
    )
    doc_mask: bool = Field(
        False,
        description="Document masking: attention does not cross the separator between the documents packed "
        "in a sequence (the end-of-text token, or tokenizer.bos/eos): block-causal FlexAttention on CUDA, a dense mask on "
        "CPU. Positions do not restart per document. Off: causal attention over the whole sequence "
        "(lmyard.models.attention).",
    )
    init_from: str | None = Field(
        None,
        description="A Hugging Face model folder (local or s3://; GPT2LMHeadModel or LlamaForCausalLM, one "
        "model.safetensors), or a model lmyard registered (models:/NAME/VERSION, models:/NAME@ALIAS, "
        "models:/NAME/latest, looked up through tracking.uri), to continue pretraining from: its weights and "
        "sizes replace the preset's (lmyard.export.hf.init_from_hf).",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in registry.presets():
            raise ValueError(f"unknown preset {v!r}; choose one of {sorted(registry.presets())} or set it to null")
        return v

    @model_validator(mode="after")
    def _complete(self) -> ModelConfig:
        dims = self.dims()
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            raise ValueError(f"model.preset is null, so model.{', model.'.join(missing)} must be set")
        n_embd, n_head = dims["n_embd"], dims["n_head"]
        assert n_embd is not None and n_head is not None  # none is missing
        if n_embd % n_head:
            raise ValueError(f"model.n_embd ({dims['n_embd']}) must be a multiple of model.n_head ({dims['n_head']})")
        preset_arch = registry.presets().get(self.preset or "", {}).get("arch", registry.DEFAULT)
        if self.preset is not None and self.arch is not None and self.arch != preset_arch:
            raise ValueError(
                f"model.arch is {self.arch} but model.preset {self.preset} is a {preset_arch} model; "
                "unset model.arch or choose a preset of that architecture"
            )
        registry.check(self)  # the family's own fields and shapes
        if self.doc_mask and self.attention != "auto":
            raise ValueError(
                f"model.attention={self.attention} picks an SDPA kernel, but model.doc_mask runs FlexAttention; "
                "leave model.attention=auto"
            )
        if self.doc_mask and self.dropout:
            raise ValueError("model.doc_mask has no attention dropout (FlexAttention); set model.dropout=0")
        return self

    def architecture(self) -> str:
        """The model family (lmyard.models.registry): model.arch, else the preset's."""
        return self.arch or registry.presets().get(self.preset or "", {}).get("arch", registry.DEFAULT)

    def dims(self) -> dict[str, int | None]:
        base = registry.presets().get(self.preset or "", {})
        return {
            k: getattr(self, k) if getattr(self, k) is not None else base.get(k)
            for k in ("n_layer", "n_head", "n_embd", "block_size")
        }
