"""The one config of a run: a validated pydantic model.

It is the Prefect flow's parameter (the UI renders a form from it), it is
logged whole to MLflow, and its relevant parts hash into content addresses.
The field defaults are the `smoke` recipe, the embedded default: a tiny
byte-level GPT trained on CPython's own documentation with 2 CPU ranks.

Named recipes are YAML files under deploy/recipes/; `--set a.b=value`
overrides any field.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from lmyard.errors import UserError


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes numbers (int, float, optionally with None or literals) and not booleans."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return bool(set(args) & {int, float}) and bool not in args


class _Section(BaseModel):
    """A config section: unknown keys are refused, and so are booleans for numbers (`max_steps: true`
    would otherwise pass as 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(v).lower()}")
        return v


class SourceConfig(_Section):
    """One source of a mixture (`data.sources`): where its documents come from and its share."""

    source: str = Field(
        ...,
        description="Hub dataset name, local file/glob (txt, jsonl, parquet), s3:// URI, or `builtin:pydoc-topics`.",
    )
    name: str | None = Field(None, description="Hub dataset config name.")
    split: str = Field("train", description="Dataset split to read.")
    revision: str | None = Field(None, description="Hub dataset revision (commit).")
    text_field: str = Field("text", description="Field that holds each document's text.")
    weight: float | None = Field(
        None,
        description="Relative share of the mixture's tokens (e.g. 3 and 1: 75% and 25%); the mixture ends "
        "when the first source runs out. Default 1 when no source sets `tokens`.",
    )
    tokens: int | None = Field(
        None,
        description="Token budget instead of a weight: the source gives this many tokens (its documents "
        "read again from the start if it runs out first); set it on every source or on none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_tokenizer(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tokenizer" in data:
            raise ValueError(
                "a shard set has one tokenizer, the `tokenizer` section: sources with different "
                "tokenizers cannot be mixed; remove `tokenizer` here or shard the sources separately"
            )
        return data

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(
                f"weight must be positive (got {v}): weights are relative shares, e.g. 3 and 1 "
                "for 75% and 25%; leave a source out instead of giving it 0"
            )
        return v

    @field_validator("tokens")
    @classmethod
    def _positive_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"tokens must be a positive token budget (got {v})")
        return v


class DataConfig(_Section):
    source: str = Field(
        "builtin:pydoc-topics",
        description="Hub dataset name, local file/glob (txt, jsonl, parquet), s3:// URI, "
        "or `builtin:pydoc-topics` (CPython's bundled documentation, ~465 KB). See `data.sources` for mixtures.",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        description="A mixture instead of `data.source`: a list of {source, text_field, name, split, "
        "revision, and weight or tokens}, interleaved document by document so that each source's share of the tokens "
        "follows its weight (or budget). The content address covers every source and its share.",
    )
    name: str | None = Field(None, description="Hub dataset config name (e.g. `sample-10BT`).")
    split: str = Field("train", description="Dataset split to read.")
    revision: str | None = Field(None, description="Hub dataset revision (commit); pins the content address.")
    text_field: str = Field("text", description="Field that holds each document's text.")
    shard_tokens: int = Field(100_000_000, gt=0, description="Tokens per shard file.")
    val_every: int = Field(10, ge=2, description="Split rule: document i goes to validation when i % val_every == 0.")
    max_documents: int | None = Field(None, gt=0, description="Stop after this many documents (smoke runs).")
    on_decode_error: Literal["error", "skip"] = Field(
        "error",
        description="Non-UTF-8 bytes in a .txt/.jsonl file: `error` stops and names the file and byte offset; "
        "`skip` drops the documents holding them (with a counted warning).",
    )
    num_proc: int | None = Field(
        None, gt=0, description="Tokenizer processes; default: every core. The shards do not depend on it."
    )
    shuffle_documents: bool = Field(
        False,
        description="Shard time: shuffle the documents before they are split and written (file pieces in "
        "a seeded order, then a seeded shuffle buffer), so similar files do not arrive together. Changes the "
        "shard set (the seed is in its address).",
    )
    shuffle_seed: int = Field(0, description="Seed of data.shuffle_documents (part of the content address).")
    shuffle_buffer_tokens: int = Field(
        16_000_000,
        gt=0,
        description="Tokens held by the document shuffle buffer (2-4 bytes each): "
        "the larger, the more global the shuffle.",
    )
    shuffle_sequences: bool = Field(
        False,
        description="Training time: read the train split's sequences in a seeded order that changes every "
        "epoch (seed: train.seed). Leaves the shards alone; resume stays exact, the order is the same for any "
        "number of ranks.",
    )

    @model_validator(mode="after")
    def _one_kind_of_share(self) -> DataConfig:
        if self.sources is None:
            return self
        if not self.sources:
            raise ValueError("data.sources is empty: list at least one source, or use data.source")
        if self.source != DataConfig.model_fields["source"].default:  # not model_fields_set: JSON round trips set all
            raise ValueError("set data.source or data.sources, not both")
        budgets = [s.tokens is not None for s in self.sources]
        if any(budgets) and not all(budgets):
            raise ValueError("data.sources: give every source a token budget (`tokens`) or none")
        if any(budgets) and any(s.weight is not None for s in self.sources):
            raise ValueError("data.sources: a source has `weight` and `tokens`; shares come from one or the other")
        return self

    def source_configs(self) -> list[DataConfig]:
        """Each source as a single-source DataConfig (the mixture's members, or this config alone)."""
        if self.sources is None:
            return [self]
        keys = ("source", "name", "split", "revision", "text_field")
        return [self.model_copy(update={**{k: getattr(s, k) for k in keys}, "sources": None}) for s in self.sources]

    def shares(self) -> tuple[list[float], list[int] | None]:
        """(relative weights, token budgets or None) of the sources, in order."""
        if self.sources is None:
            return [1.0], None
        if self.sources[0].tokens is not None:
            budgets = [s.tokens for s in self.sources]
            return [float(b) for b in budgets], budgets
        return [s.weight if s.weight is not None else 1.0 for s in self.sources], None


class TokenizerConfig(_Section):
    name: str = Field(
        "bytes",
        description="`bytes` (256 byte tokens + end-of-text, built in code) or a tiktoken "
        "encoding: gpt2 / r50k_base, p50k_base, cl100k_base, o200k_base.",
    )
    ranks_file: str | None = Field(
        None, description="A .tiktoken ranks file (local path or s3:// URI) for the named encoding."
    )
    file: str | None = Field(
        None,
        description="A Hugging Face `tokenizers` tokenizer.json instead of tokenizer.name: a local path, "
        "an s3:// URI, or `hf://ORG/REPO` (`hf://ORG/REPO@REVISION`) from the hub. Declare its document "
        "separator with tokenizer.bos and/or tokenizer.eos.",
    )
    bos: str | None = Field(
        None,
        description="Special token written before every document. Default for tiktoken encodings and "
        "`bytes`: their end-of-text token (llm.c's convention); for a tokenizer.json e.g. Llama 3's begin-of-text "
        "token or `<s>`.",
    )
    eos: str | None = Field(None, description="Special token written after every document (e.g. `</s>`); default none.")

    @model_validator(mode="after")
    def _one_kind(self) -> TokenizerConfig:
        if self.file is not None and self.name != TokenizerConfig.model_fields["name"].default:
            raise ValueError("set tokenizer.name (tiktoken) or tokenizer.file (tokenizer.json), not both")
        if self.file is not None and self.ranks_file is not None:
            raise ValueError("tokenizer.ranks_file belongs to tiktoken encodings; unset it with tokenizer.file")
        if self.file is not None and self.bos is None and self.eos is None:
            raise ValueError(
                "tokenizer.file needs tokenizer.bos or tokenizer.eos: name the special token that "
                "separates documents (e.g. `<|begin_of_text|>`, `<s>` or `</s>`)"
            )
        return self


PRESETS: dict[str, dict] = {
    # name: layers, heads, width, context (GPT-2 unless `arch` says otherwise)
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    # Llama 3 shapes: + kv heads, SwiGLU width rule (multiple_of, ffn_dim_multiplier), RoPE theta
    "llama-tiny": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, multiple_of=32),
    "llama-150m": dict(arch="llama", n_layer=12, n_head=12, n_kv_head=4, n_embd=768, block_size=2048),
    "llama-1b": dict(
        arch="llama",
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        block_size=2048,  # Llama-3.2-1B
        multiple_of=1024,
        ffn_dim_multiplier=1.5,
        vocab_size=128256,
    ),
    "llama-3b": dict(
        arch="llama",
        n_layer=28,
        n_head=24,
        n_kv_head=8,
        n_embd=3072,
        block_size=2048,  # Llama-3.2-3B
        multiple_of=1024,
        ffn_dim_multiplier=1.0,
        vocab_size=128256,
    ),
    "llama-8b": dict(
        arch="llama",
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        block_size=8192,  # Llama-3-8B
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        vocab_size=128256,
    ),
}

LLAMA_DEFAULTS = dict(n_kv_head=None, multiple_of=256, ffn_dim_multiplier=None, rope_theta=500000.0, norm_eps=1e-5)


class ModelConfig(_Section):
    preset: str | None = Field("tiny", description=f"One of {sorted(PRESETS)}, or null for free-form sizes.")
    arch: Literal["gpt2", "llama"] | None = Field(
        None,
        description="`gpt2` (LayerNorm, GELU, learned positions, tied embeddings) or `llama` (RMSNorm, "
        "SwiGLU, RoPE, grouped-query attention, untied, no biases); default: the preset's, gpt2 for free sizes.",
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
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="SDPA kernel: `auto` lets PyTorch choose; `cudnn` is often fastest on Hopper GPUs."
    )
    init_from: str | None = Field(
        None,
        description="A Hugging Face model folder (local or s3://; GPT2LMHeadModel or LlamaForCausalLM, one "
        "model.safetensors) to continue pretraining from: its weights and sizes replace the preset's "
        "(lmyard.export.init_from_hf).",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {sorted(PRESETS)} or set it to null")
        return v

    @model_validator(mode="after")
    def _complete(self) -> ModelConfig:
        dims = self.dims()
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            raise ValueError(f"model.preset is null, so model.{', model.'.join(missing)} must be set")
        if dims["n_embd"] % dims["n_head"]:
            raise ValueError(f"model.n_embd ({dims['n_embd']}) must be a multiple of model.n_head ({dims['n_head']})")
        preset_arch = PRESETS.get(self.preset or "", {}).get("arch", "gpt2")
        if self.preset is not None and self.arch is not None and self.arch != preset_arch:
            raise ValueError(
                f"model.arch is {self.arch} but model.preset {self.preset} is a {preset_arch} model; "
                "unset model.arch or choose a preset of that architecture"
            )
        if self.architecture() == "gpt2":
            given = [k for k in LLAMA_DEFAULTS if getattr(self, k) is not None]
            if given:
                raise ValueError(f"model.{', model.'.join(given)} apply to llama models only; set model.arch=llama")
            return self
        d = self.llama_dims()
        if d["n_head"] % d["n_kv_head"]:
            raise ValueError(f"model.n_head ({d['n_head']}) must be a multiple of model.n_kv_head ({d['n_kv_head']})")
        if (d["n_embd"] // d["n_head"]) % 2:
            raise ValueError(f"llama's head size n_embd / n_head ({d['n_embd']} / {d['n_head']}) must be even (RoPE)")
        if self.dropout:
            raise ValueError("model.dropout is GPT-2 only; llama models train without dropout")
        return self

    def architecture(self) -> str:
        """`gpt2` or `llama`: model.arch, else the preset's."""
        return self.arch or PRESETS.get(self.preset or "", {}).get("arch", "gpt2")

    def dims(self) -> dict[str, int | None]:
        base = PRESETS.get(self.preset or "", {})
        return {
            k: getattr(self, k) if getattr(self, k) is not None else base.get(k)
            for k in ("n_layer", "n_head", "n_embd", "block_size")
        }

    def llama_dims(self) -> dict:
        """The llama fields resolved: set value, else the preset's, else Llama 3's default."""
        base = {**LLAMA_DEFAULTS, **PRESETS.get(self.preset or "", {})}
        d = {
            k: getattr(self, k) if getattr(self, k) is not None else base.get(k)
            for k in ("vocab_size", *LLAMA_DEFAULTS)
        }
        d = {**self.dims(), **d}
        d["n_kv_head"] = d["n_kv_head"] or d["n_head"]
        return d


class GuardConfig(_Section):
    policy: Literal["stop", "rollback"] = Field(
        "stop",
        description="On divergence: `stop` with an error, or `rollback` to the last checkpoint and "
        "skip the batches between it and the bad step.",
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="A checked loss above spike_factor x the running mean of earlier checked losses "
        "is divergence too; null: only non-finite losses are.",
    )
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks allowed in one run before it stops.")


class TrainConfig(_Section):
    max_steps: int = Field(800, gt=0, description="Optimizer steps in the whole run.")
    batch_tokens: int = Field(4096, gt=0, description="Tokens per optimizer step, all ranks and micro-steps together.")
    micro_batch: int = Field(16, gt=0, description="Sequences per rank per forward/backward.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine decay).")
    warmup_steps: int = Field(40, ge=0)
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay, applied to matrices only.")
    beta1: float = Field(0.9, gt=0, lt=1)
    beta2: float = Field(0.95, gt=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    seed: int = 1337
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto`: CUDA when present.")
    compile: bool | None = Field(None, description="torch.compile the model; default: on for CUDA.")
    threads_per_rank: int | None = Field(None, gt=0, description="CPU threads per rank; default: cores / local ranks.")
    log_interval: int = Field(20, gt=0, description="Steps between metric logs (and divergence checks).")
    ddp_bucket_mb: float = Field(
        25.0,
        gt=0,
        description="DDP gradient bucket size (MB): each bucket's all-reduce starts as soon as its "
        "gradients are ready, overlapping the rest of backward.",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="`ddp`: every rank holds the whole model, gradients and AdamW state; `fsdp`: FSDP2 shards "
        "them over the ranks (fully_shard per block and at the root; bf16 parameters, fp32 gradient reduction on CUDA).",
    )
    fsdp_reshard_after_forward: bool = Field(
        True,
        description="fsdp: free each block's gathered parameters after its forward (gather again for backward); "
        "false keeps them until backward: less communication, more memory.",
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none",
        description="Recompute activations in backward instead of keeping them: `full` recomputes every "
        "block; `selective` keeps matmul and attention outputs except every second matmul's (torchtitan's op-level "
        "policy).",
    )
    float8: bool = Field(
        False,
        description="torchao float8 linears in the blocks (GPUs of compute capability 8.9+ "
        "with torchao installed; otherwise skipped with a warning).",
    )
    guard: GuardConfig = Field(default_factory=GuardConfig)


class EvalGates(_Section):
    val_loss_max: float | None = Field(None, gt=0, description="The final val loss must be at most this.")
    hellaswag_acc_norm_min: float | None = Field(
        None, ge=0, le=1, description="The final HellaSwag acc_norm must be at least this."
    )

    def configured(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def gate_results(gates: EvalGates, result: dict) -> dict[str, dict]:
    """Each configured gate: {value, limit, passed}; a gate whose metric was not measured fails."""
    hs = result.get("hellaswag") or {}
    measured = {"val_loss_max": result.get("val_loss"), "hellaswag_acc_norm_min": hs.get("acc_norm")}
    out = {}
    for name, limit in gates.configured().items():
        value = measured[name]
        passed = value is not None and (value <= limit if name.endswith("_max") else value >= limit)
        out[name] = {"value": value, "limit": limit, "passed": passed}
    return out


class EvalConfig(_Section):
    interval: int = Field(100, gt=0, description="Steps between validation-loss evaluations.")
    val_tokens: int = Field(32768, gt=0, description="Validation tokens scored per evaluation.")
    prompts: list[str] = Field(
        default_factory=lambda: ["The for statement", "Exceptions are", "A class is"],
        description="Fixed prompts sampled at the end of the run.",
    )
    sample_tokens: int = Field(160, ge=0, description="Tokens generated per prompt.")
    temperature: float = Field(0.8, gt=0)
    top_k: int | None = Field(40, gt=0)
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="Where checkpoint evaluation runs: `cpu`, or a spare GPU (`cuda:N`) so it does not slow training.",
    )
    threads: int | None = Field(None, gt=0, description="CPU threads of the evaluator; default: torch's default.")
    watch: bool = Field(
        True,
        description="Evaluate each new checkpoint while training runs (else every checkpoint after training ends).",
    )
    poll_s: float = Field(5.0, gt=0, description="Seconds between looks at the store for new checkpoints.")
    hellaswag: str | None = Field(
        None,
        description="HellaSwag-format multiple choice (ctx, endings, label): a JSONL path or s3:// URI, "
        "or a hub dataset name (e.g. `Rowan/hellaswag`); null: skipped.",
    )
    hellaswag_split: str = Field("validation", description="Split of a hub HellaSwag dataset.")
    hellaswag_limit: int | None = Field(None, gt=0, description="Score only the first N examples.")
    harness_tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks run on each checkpoint's Hugging Face "
        "export (needs the `harness` extra), offline: `hellaswag_local` scores eval.hellaswag's local JSONL; "
        "other tasks come from eval.harness_include or lm-eval's own list, with their data in the local "
        "datasets cache. Results are logged as harness/<task>/<metric> at the checkpoint's step.",
    )
    harness_include: str | None = Field(
        None, description="A folder of lm-eval task YAML files (e.g. with `dataset_path: json` on local files)."
    )
    harness_limit: int | None = Field(None, gt=0, description="Examples per lm-eval task (default: all).")
    gates: EvalGates = Field(default_factory=lambda: EvalGates())
    alias: str = Field(
        "candidate",
        pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
        description="Registry alias the final model version gets when every configured gate passes.",
    )


class CheckpointConfig(_Section):
    interval: int = Field(100, gt=0, description="Steps between checkpoints (the last step is always saved).")
    keep_last: int = Field(3, ge=2, description="Newest checkpoints kept (2 at least: the newest may still be read).")
    keep_every: int | None = Field(None, gt=0, description="Also keep every step that is a multiple of this.")
    keep_best: bool = Field(True, description="Also keep the checkpoint with the lowest validation loss.")
    max_pending: int = Field(
        2, ge=1, description="Checkpoints that may wait for an unreachable store before training stops."
    )
    upload_retries: int = Field(6, ge=0, description="Retries of a failed upload (backoff 1, 2, 4 ... 30 s).")


class DockerConfig(_Section):
    """One container per node, through the Docker engine of each node (see docs/docker.md)."""

    nodes: list[str] = Field(
        default_factory=lambda: ["unix:///var/run/docker.sock"],
        min_length=1,
        description="Docker engine URL of each node: unix:///var/run/docker.sock, tcp://host:2376 (TLS), "
        "ssh://user@host. One URL puts every node on that engine.",
    )
    image: str | None = Field(
        None,
        description="Stage image; default lmyard-stage:<code version> "
        "(built by `python -m lmyard.launch.images build`).",
    )
    network: Literal["host", "bridge"] = Field(
        "host",
        description="`host`: the host's network (NCCL across hosts); `bridge`: a user-defined bridge "
        "network made for the run, for nodes that share one engine.",
    )
    gpus: int | Literal["all"] = Field(
        0, description="GPUs per node (NVIDIA container toolkit): a count or `all`; 0 runs on the CPU."
    )
    gpu_ids: list[str] | None = Field(None, description="GPU indices or UUIDs per node, instead of a count.")
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="c10d rendezvous port on node 0.")
    socket_ifname: str | None = Field(
        None,
        description="Interface(s) for NCCL and gloo traffic (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), "
        "e.g. `eth0` or `^docker0,lo`.",
    )
    shm_size: str = Field("16g", description="/dev/shm size (DataLoader workers and NCCL use it).")
    ulimits: dict[str, int] = Field(
        default_factory=lambda: {"memlock": -1, "stack": 64 << 20},
        description="Container ulimits, soft = hard (-1: unlimited). memlock unlimited lets NCCL/InfiniBand "
        "pin memory; an engine without CAP_SYS_RESOURCE can only lower it.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment (e.g. NCCL_IB_HCA, NCCL_DEBUG). Logged with the "
        "config: never put secrets here; name them in pass_env.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the launching process passed to the containers, "
        "besides every AWS_* one (e.g. MLFLOW_TRACKING_TOKEN); their values are never logged.",
    )
    volumes: list[str] = Field(
        default_factory=list,
        description="Extra bind mounts `host:container[:ro]`. "
        "A local-folder store is mounted at its own path without being listed.",
    )
    user: str | None = Field(
        None,
        description="uid[:gid] in the containers; default the image's non-root "
        "user (uid 1000), which must be able to write a local-folder store.",
    )
    tls_cert_dir: str | None = Field(
        None, description="ca.pem, cert.pem, key.pem for tcp:// engines; default DOCKER_CERT_PATH."
    )

    @model_validator(mode="after")
    def _check(self) -> DockerConfig:
        if self.gpu_ids is not None and self.gpus != 0:
            raise ValueError("set launch.docker.gpus or launch.docker.gpu_ids, not both")
        if isinstance(self.gpus, int) and self.gpus < 0:
            raise ValueError("launch.docker.gpus must be >= 0 or `all`")
        if self.network == "bridge" and len(set(self.nodes)) > 1:
            raise ValueError("launch.docker.network=bridge needs every node on one engine; use `host` across hosts")
        return self


class RayConfig(_Section):
    """One actor per node in a placement group of a Ray cluster (see docs/ray.md)."""

    address: str | None = Field(
        None,
        description="The Ray cluster's address (host:port of the head's GCS, or `auto`); "
        "default RAY_ADDRESS, else `auto` (the cluster this machine belongs to).",
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs of each node's bundle; 0 runs on the CPU.")
    cpus_per_node: float | None = Field(
        None, gt=0, description="CPUs of each node's bundle; default launch.nproc_per_node (one per rank)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom resources of each node\'s bundle, e.g. `{"accelerator_type:H100": 1}`.',
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env of the node actors (env_vars, pip, image_uri, ...); empty: the nodes' "
        "own environment (a cluster started from the stage image). Logged with the config: no secrets here.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the launching process passed to torchrun on every node, "
        "besides every AWS_* one (e.g. MLFLOW_TRACKING_TOKEN); their values are never logged.",
    )
    placement_timeout_s: float = Field(
        600, gt=0, description="How long to wait for the placement group and the actors (a busy cluster)."
    )


class LaunchConfig(_Section):
    backend: Literal["local", "docker", "ray"] = "local"
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(2, gt=0, description="Ranks per node (GPUs per node on CUDA).")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of node 0 for multi-node rendezvous (docker: default from node 0's URL)."
    )
    retries: int = Field(
        1,
        ge=0,
        description="Retries of the train task after a failure that is not a user "
        "error (a dead node, a crashed rank); each resumes from the newest checkpoint.",
    )
    watchdog_s: float | None = Field(
        900, gt=0, description="Kill the job when no step completes for this long (after the first); null: never."
    )
    grace_s: float = Field(
        120,
        gt=0,
        description="After SIGTERM (a spot reclaim, `docker stop`, a cancelled run), the seconds the "
        "trainer has to checkpoint the current step and exit as preempted before it is killed.",
    )
    docker: DockerConfig = Field(default_factory=DockerConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _nodes_match(self) -> LaunchConfig:
        if self.backend == "docker" and len(self.docker.nodes) not in (1, self.nnodes):
            raise ValueError(
                f"launch.docker.nodes lists {len(self.docker.nodes)} engines for launch.nnodes="
                f"{self.nnodes}: give one URL per node, or one for all"
            )
        urls = self.docker.nodes * (self.nnodes // len(self.docker.nodes))
        remote = [u for u in urls if not u.startswith("unix://")]
        if self.backend == "docker" and self.docker.network == "host" and len(remote) != len(set(remote)):
            raise ValueError(
                "launch.docker.nodes puts several nodes on one remote engine with host networking, "
                "where they would share one address: list one host per node, or use network=bridge"
            )
        return self


class TrackingConfig(_Section):
    uri: str = Field("sqlite:///.lmyard/mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("lmyard", description="MLflow experiment name.")
    registered_model: str | None = Field(
        None, description="Model registry name of the final model; default: the run_name."
    )
    system_metrics: bool = Field(True, description="Log CPU, memory, disk, network (and GPU) metrics per node.")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between system metric samples.")
    lease_ttl_s: float = Field(
        60.0,
        ge=3,
        description="One run writes a lineage at a time: it holds a lease on runs/<run_name>, renewed "
        "every ttl/3; a lease not renewed for this long (its holder died) may be taken over.",
    )
    lease_wait_s: float = Field(
        90.0,
        ge=0,
        description="How long a run waits for another run of the same lineage to end (or for a dead "
        "holder's lease to expire) before it refuses, naming the holder.",
    )


class RunConfig(_Section):
    store: str = Field(".lmyard/store", description="Root URI of shards and runs: a local path or s3://bucket/prefix.")
    run_name: str = Field("smoke", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The lineage's name.")
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    def redacted_dump(self) -> dict[str, Any]:
        """model_dump(mode="json") with the password of every URI removed (see redact_uri): what may be
        logged or saved (MLflow params, lineage.json, checkpoint state)."""

        def walk(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            return redact_uri(value) if isinstance(value, str) else value

        return walk(self.model_dump(mode="json"))

    def flat(self) -> dict[str, str]:
        """Dotted key -> value, for MLflow params (credentials in URIs redacted)."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)

        walk("", self.redacted_dump())
        return out


_USERINFO = re.compile(r"(\w[\w+.-]*://[^/\s:@]+):[^/\s]*@")


def redact_uri(uri: str) -> str:
    """`uri` without the password of its `user:password@` part (`http://me:s3cret@host` -> `http://me:***@host`);
    any URI inside a longer text (an error message) too; other strings as they are."""
    return _USERINFO.sub(r"\1:***@", uri)


# ---------------------------------------------------------------- recipes

RECIPE_DIRS = (Path.cwd() / "deploy" / "recipes", Path(__file__).resolve().parents[1] / "deploy" / "recipes")


def builtin_recipes() -> list[str]:
    names = {"smoke"}
    for d in RECIPE_DIRS:
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def _recipe_dict(recipe: str) -> dict[str, Any]:
    if recipe == "smoke":
        return {}
    path = Path(recipe)
    if not path.suffix:
        for d in RECIPE_DIRS:
            if (d / f"{recipe}.yaml").is_file():
                path = d / f"{recipe}.yaml"
                break
    if not path.is_file():
        raise UserError(
            f"unknown recipe {recipe!r}: give a built-in name ({', '.join(builtin_recipes())}) "
            "or the path of a YAML file"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of config sections")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` to a nested dict; the value is parsed as YAML."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set train.max_steps=50")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    msgs = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            msgs.append(f"unknown config key {loc!r} (see the config reference: `lmyard config`)")
        else:
            got = e.get("input")
            msg = e["msg"].removeprefix("Value error, ")
            if isinstance(got, (str, int, float, bool)) and e["type"] not in ("value_error",):
                msgs.append(f"{loc}: {msg}, got {got!r}" if loc else msg)
            else:
                msgs.append(f"{loc}: {msg}" if loc else msg)
    return "invalid config: " + "; ".join(msgs)


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e)) from None


def load_recipe(recipe: str = "smoke", overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A recipe by built-in name or YAML path, with `dotted.key=value` overrides applied."""
    data = _recipe_dict(recipe)
    for assignment in overrides:
        apply_override(data, assignment)
    return validate(data)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_recipe(config: RunConfig, recipe: str | None) -> RunConfig:
    """`config` on top of a recipe: the recipe's values, then every field `config` sets explicitly.

    This is how a deployment points at its recipe (parameter `recipe`) while a run still overrides any
    field through `config`; with no recipe, `config` as it is.
    """
    if not recipe:
        return config
    return validate(_merge(_recipe_dict(recipe), config.model_dump(mode="json", exclude_unset=True)))


def digest(obj: Any, n: int = 16) -> str:
    """A short, stable content hash of JSON-able data."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the model: key, type, default, meaning."""
    import typing

    lines = [
        "# Config reference",
        "",
        "Generated from `lmyard/config.py` by `lmyard config --reference`; the defaults are the `smoke` recipe.",
        "Set any key in a recipe YAML or with `--set key=value`.",
        "",
    ]

    def type_name(ann) -> str:
        args = typing.get_args(ann)
        if typing.get_origin(ann) is Literal:
            return " \\| ".join(f"`{a}`" for a in args)
        if typing.get_origin(ann) is list:
            return f"list[{type_name(args[0])}]"
        if args:
            return " \\| ".join(type_name(a) for a in args)
        return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))

    def walk(model: type[BaseModel], prefix: str, instance: BaseModel) -> None:
        rows = []
        for name, field in model.model_fields.items():
            value = getattr(instance, name)
            if isinstance(value, BaseModel):
                walk(type(value), f"{prefix}{name}.", value)
                continue
            default = json.dumps(value) if not isinstance(value, str) else f"`{value}`"
            rows.append(
                f"| `{prefix}{name}` | {type_name(field.annotation)} | {default} | "
                f"{(field.description or '').replace('|', '/')} |"
            )
        if rows:
            lines.extend(
                [
                    f"## {prefix.rstrip('.') or 'run'}",
                    "",
                    "| key | type | default | meaning |",
                    "| --- | --- | --- | --- |",
                    *rows,
                    "",
                ]
            )

    walk(RunConfig, "", RunConfig())
    return "\n".join(lines)
