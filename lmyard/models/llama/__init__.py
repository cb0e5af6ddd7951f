"""The Llama family as a spec (lmyard.models.spec): Llama 3 presets and shapes, Hugging Face's
LlamaForCausalLM, memory terms, FSDP units.

Torch-free: the config validates against it in the flow's process; the nn.Module is in `model.py`
(imported by `build`). lmyard's weight names are HF's without `model.`, but for q, k and v fused in
`qkv_proj` (stacked by rows): an export splits its rows, an import stacks them; RoPE is HF's half
rotation, so nothing is permuted.
"""

from __future__ import annotations

import math

from lmyard.errors import UserError
from lmyard.models.spec import HFAdapter, ModelSpec, Scaling, Terms

PRESETS: dict[str, dict] = {
    # Llama 3 shapes: layers, heads, kv heads, width, context, SwiGLU width rule (multiple_of, ffn_dim_multiplier)
    "llama-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, multiple_of=32),
    "llama-150m": dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, block_size=2048),
    "llama-1b": dict(  # Llama-3.2-1B
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        block_size=2048,
        multiple_of=1024,
        ffn_dim_multiplier=1.5,
        vocab_size=128256,
    ),
    "llama-3b": dict(  # Llama-3.2-3B
        n_layer=28,
        n_head=24,
        n_kv_head=8,
        n_embd=3072,
        block_size=2048,
        multiple_of=1024,
        ffn_dim_multiplier=1.0,
        vocab_size=128256,
    ),
    "llama-8b": dict(  # Llama-3-8B
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        block_size=8192,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        vocab_size=128256,
    ),
}

# model.* fields only Llama reads, and their defaults where neither the user nor the preset sets them
DEFAULTS = dict(n_kv_head=None, multiple_of=256, ffn_dim_multiplier=None, rope_theta=500000.0, norm_eps=1e-5)


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama 3's SwiGLU width: 2/3 of 4d, times the multiplier, rounded up to a multiple of `multiple_of`
    (d=2048, x1.5, 1024 -> 8192; d=4096, x1.3, 1024 -> 14336)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def settings(cfg) -> dict:
    """The llama fields of `model.*` resolved: set value, else the preset's, else Llama 3's default."""
    base = {**DEFAULTS, **PRESETS.get(cfg.preset or "", {})}
    d = {k: getattr(cfg, k) if getattr(cfg, k) is not None else base.get(k) for k in ("vocab_size", *DEFAULTS)}
    d = {**cfg.dims(), **d}
    d["n_kv_head"] = d["n_kv_head"] or d["n_head"]
    return d


def resolve(cfg, n_vocab: int) -> dict:
    """LlamaConfig's fields of `model.*` (lmyard.config.ModelConfig); vocab: the preset's or the tokenizer's
    padded to 64."""
    d = settings(cfg)
    vocab = d.pop("vocab_size") or 64 * math.ceil(n_vocab / 64)
    ffn = ffn_hidden_size(d["n_embd"], d.pop("multiple_of"), d.pop("ffn_dim_multiplier"))
    return {"vocab_size": vocab, "ffn_hidden": ffn, **d}


def check(cfg) -> None:
    d = settings(cfg)
    if d["n_head"] % d["n_kv_head"]:
        raise ValueError(f"model.n_head ({d['n_head']}) must be a multiple of model.n_kv_head ({d['n_kv_head']})")
    if (d["n_embd"] // d["n_head"]) % 2:
        raise ValueError(f"llama's head size n_embd / n_head ({d['n_embd']} / {d['n_head']}) must be even (RoPE)")
    if cfg.dropout:
        raise ValueError("model.dropout is GPT-2 only; llama models train without dropout")


def build(fields: dict):
    from lmyard.models.llama.model import Llama, LlamaConfig

    return Llama(LlamaConfig(**fields))


def config(fields: dict):
    from lmyard.models.llama.model import LlamaConfig

    return LlamaConfig(**fields)


def terms(c: dict) -> Terms:
    """Block: qkv d(d + 2kv), out d^2, SwiGLU 3df, two RMSNorms 2d. Root: two tables (untied), the final
    norm; the input table is a lookup (torchtitan counts no FLOPs for it). Activations per block and token,
    bf16: 14d + 4kv + 8f eager (d width, kv key/value width, f SwiGLU width); 13d + 4kv + 6f compiled: 12d +
    4kv + 6f counted from a compiled block's saved tensors (the block's input, both norms' outputs, q k v,
    attention's output in two layouts, SwiGLU's three (T, f) tensors; SiLU and RoPE recomputed), plus d so
    that the plan stays above the measured peak (Llama-3 8B at seq 8192 on 4 H100s: 66.5 GiB allocated, 65.9
    planned with 12d); 8d + 4kv + 2f keeping every second matmul's output; the block's input 2d under full.
    `pointwise` keeps the input, qkv, attention's output, o_proj's, the gate's and the up projection's: 10d + 4kv +
    4f eager (the down projection's output too); compiled 8d + 4kv + 4f counted from a compiled block's saved
    tensors, plus d as for none."""
    d, f, V = c["n_embd"], c["ffn_hidden"], c["vocab_size"]
    kv = c["n_kv_head"] * (d // c["n_head"])
    return Terms(
        block=d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d,
        root=2 * V * d + d,
        lookup=V * d,
        activations={
            "none": 14 * d + 4 * kv + 8 * f,
            "pointwise": 10 * d + 4 * kv + 4 * f,
            "selective": 8 * d + 4 * kv + 2 * f,
            "full": 2 * d,
        },
        compiled={"none": 13 * d + 4 * kv + 6 * f, "pointwise": 9 * d + 4 * kv + 4 * f},
    )


def fsdp_units(model) -> list[tuple[list, bool]]:
    """torchtitan's units besides the blocks: the embeddings; the final norm with the head, kept gathered from
    forward to backward (backward needs them at once), so the head's gradients are reduced while the blocks'
    backward runs."""
    return [([model.embed_tokens], True), ([model.norm, model.lm_head], False)]


# ---------------------------------------------------------------- Hugging Face: LlamaForCausalLM


def hf_config(dims: dict, eot: int) -> dict:
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


def _qkv_sizes(dims: dict) -> list[int]:
    head = dims["n_embd"] // dims["n_head"]
    return [dims["n_head"] * head, dims["n_kv_head"] * head, dims["n_kv_head"] * head]


def to_hf(sd: dict, dims: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            base = "model." + k.removesuffix("qkv_proj.weight")
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.split(_qkv_sizes(dims), dim=0)):
                out[f"{base}{name}.weight"] = part
        else:
            out[k if k.startswith("lm_head.") else f"model.{k}"] = v
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
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


SPEC = ModelSpec(
    name="llama",
    summary="RMSNorm, SwiGLU, RoPE, grouped-query attention, untied, no biases",
    presets=PRESETS,
    fields=tuple(DEFAULTS),
    resolve=resolve,
    check=check,
    build=build,
    config=config,
    hf=HFAdapter(architecture="LlamaForCausalLM", config=hf_config, to_hf=to_hf, from_hf=from_hf),
    terms=terms,
    # head size and the SwiGLU rule (a multiple of the width) kept
    scaling=Scaling(
        scaled=("n_embd", "n_head", "n_kv_head"),
        fixed=("n_layer", "block_size", "multiple_of", "ffn_dim_multiplier"),
    ),
    fsdp_units=fsdp_units,
)
