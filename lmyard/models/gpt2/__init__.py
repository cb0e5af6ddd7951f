"""The GPT-2 family as a spec (lmyard.models.spec): presets, shape, Hugging Face's GPT2LMHeadModel, memory terms.

Torch-free: the config validates against it in the flow's process; the nn.Module is in `model.py`, imported
by `build`. Hugging Face's GPT-2 stores its projections as Conv1D, (in, out): the transpose of nn.Linear's;
its head is tied to `wte` and not saved. A model without biases (`model.bias=false`) exports zero biases:
the same function.
"""

from __future__ import annotations

import math

from lmyard.errors import UserError
from lmyard.models.spec import HFAdapter, ModelSpec, Scaling, Terms

PRESETS: dict[str, dict] = {
    # name: layers, heads, width, context
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
}


def resolve(cfg, n_vocab: int) -> dict:
    """GPTConfig's fields of `model.*` (lmyard.config.ModelConfig); vocab: the tokenizer's, padded to 64."""
    vocab = cfg.vocab_size or 64 * math.ceil(n_vocab / 64)  # a multiple of 64 for fast matmuls
    return {"vocab_size": vocab, **cfg.dims(), "dropout": cfg.dropout, "bias": cfg.bias}


def check(cfg) -> None:
    """Any n_layer, n_head dividing n_embd (checked by the config for every family) builds."""


def build(fields: dict):
    from lmyard.models.gpt2.model import GPT, GPTConfig

    return GPT(GPTConfig(**fields))


def config(fields: dict):
    from lmyard.models.gpt2.model import GPTConfig

    return GPTConfig(**fields)


def terms(c: dict) -> Terms:
    """Block: qkv 3d^2, out d^2, MLP 8d^2, with biases 9d more, two LayerNorms 2d (4d with biases). Root: the
    tied token table, the positions, ln_f. Activations per block and token, bf16 (Korthikanti et al. 2022,
    flash attention): 34d eager, 16d keeping every second matmul's output, 20d keeping every matmul's
    (`pointwise`: both projections' outputs, 2d each, besides), the block's input 2d under full."""
    d, bias = c["n_embd"], c.get("bias", True)
    return Terms(
        block=12 * d * d + (13 * d if bias else 2 * d),
        root=c["vocab_size"] * d + c["block_size"] * d + (2 * d if bias else d),
        lookup=0,  # nanoGPT's 6N counts the tied table (it is the head's matmul too) and the positions
        activations={"none": 34 * d, "pointwise": 20 * d, "selective": 16 * d, "full": 2 * d},
    )


# ---------------------------------------------------------------- Hugging Face: GPT2LMHeadModel

_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF's Conv1D: (in, out)
_BIASED = ("ln_1", "ln_2", *_CONV1D)


def hf_config(dims: dict, eot: int) -> dict:
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
        "activation_function": "gelu_new",  # tanh-approximated GELU, as lmyard.models.gpt2.model.MLP
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


def to_hf(sd: dict, dims: dict) -> dict:
    import torch

    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
    }
    out["transformer.ln_f.bias"] = sd.get("ln_f.bias", torch.zeros_like(sd["ln_f.weight"]))
    for i in range(dims["n_layer"]):
        for name in _BIASED:
            w = sd[f"h.{i}.{name}.weight"]
            out[f"transformer.h.{i}.{name}.weight"] = w.t() if name in _CONV1D else w
            out[f"transformer.h.{i}.{name}.bias"] = sd.get(f"h.{i}.{name}.bias", torch.zeros(w.shape[0], dtype=w.dtype))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}  # lm_head is tied to wte: not saved


def from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
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
    sd = {name: tensors[f"{prefix}{name}"] for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(config["n_layer"]):
        for name in _BIASED:
            w = tensors[f"{prefix}h.{i}.{name}.weight"]
            sd[f"h.{i}.{name}.weight"] = w.t().contiguous() if name in _CONV1D else w
            sd[f"h.{i}.{name}.bias"] = tensors[f"{prefix}h.{i}.{name}.bias"]
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd, dims


SPEC = ModelSpec(
    name="gpt2",
    summary="LayerNorm, GELU, learned positions, tied embeddings",
    presets=PRESETS,
    fields=(),
    resolve=resolve,
    check=check,
    build=build,
    config=config,
    hf=HFAdapter(architecture="GPT2LMHeadModel", config=hf_config, to_hf=to_hf, from_hf=from_hf),
    terms=terms,
    scaling=Scaling(scaled=("n_embd", "n_head"), fixed=("n_layer", "block_size")),  # head size and MLP ratio kept
)
