"""Memory planning before the first step: what each GPU will hold, and what to change when it will not fit.

`estimate(model_cfg, train_cfg, world, device_bytes)` -> Plan, per GPU, in bytes:

- params: fp32 weights (whole under ddp, 1/world under fsdp).
- grads: fp32 gradients, likewise.
- optimizer: AdamW's two fp32 moments, likewise.
- working: bf16 copies of the weights made for compute: under ddp autocast's cast of every weight;
  under fsdp the gathered bf16 blocks (two at a time with reshard-after-forward, every block without),
  a block's fp32 unsharded gradients on their way to reduce-scatter, and the root unit (embeddings,
  head) gathered with its unsharded gradients.
- activations: what backward keeps, bf16, for micro_batch x block_size tokens: per block and token the
  family's figure (its spec's `terms`, e.g. GPT-2 34d eager, Korthikanti et al. 2022 with flash attention);
  `selective` keeps matmul and attention outputs but every second matmul's; `full` keeps each block's input
  (2d) plus one block's worth during its recomputation. Plus the logits (bf16, their gradient is written
  in place).
- reserve: 10% of the device for the CUDA context, NCCL buffers and allocator fragmentation.

The figures are estimates (an upper end for eager, torch.compile saves a little); `check(plan)` raises a
UserError naming the changes that would fit: fsdp, activation checkpointing, a smaller micro-batch, more GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmyard.config import ModelConfig, TrainConfig
from lmyard.errors import UserError
from lmyard.models import registry

GIB = 2**30
RESERVE = 0.10


@dataclass(frozen=True)
class Plan:
    params: int
    grads: int
    optimizer: int
    working: int
    activations: int
    device_bytes: int
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    world: int
    n_vocab: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.working + self.activations

    @property
    def usable(self) -> int:
        return int(self.device_bytes * (1 - RESERVE))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def summary(self) -> str:
        parts = ", ".join(
            f"{k} {getattr(self, k) / GIB:.1f}" for k in ("params", "grads", "optimizer", "working", "activations")
        )
        return (
            f"{self.total / GIB:.1f} GiB per GPU ({parts}) of {self.usable / GIB:.1f} usable "
            f"({self.device_bytes / GIB:.1f} GiB less {RESERVE:.0%})"
        )


def _shape(model_cfg: ModelConfig, n_vocab: int) -> dict:
    """Parameter counts (total, one block, root) and per-token activation bytes per block by AC mode, from the
    family's terms (lmyard.models.spec.Terms)."""
    c = registry.resolve(model_cfg, n_vocab)
    t = registry.spec(model_cfg.architecture()).terms(c)
    L = c["n_layer"]
    n = L * t.block + t.root
    return {
        "n": n,
        "block": t.block,
        "root": t.root,
        "L": L,
        "V": c["vocab_size"],
        "T": c["block_size"],
        "act": t.activations,
    }


def estimate(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world: int, device_bytes: int, n_vocab: int = 50257
) -> Plan:
    """Per-GPU bytes of a training step (see the module docstring); n_vocab: the tokenizer's, for models
    whose vocab_size is not fixed by the config."""
    s = _shape(model_cfg, n_vocab)
    fsdp = train_cfg.parallel == "fsdp"
    shards = world if fsdp else 1
    n = s["n"]
    if fsdp:
        gathered = 2 * s["block"] * (2 if train_cfg.fsdp_reshard_after_forward else s["L"])
        working = gathered + 4 * s["block"] + 6 * s["root"]  # + a block's fp32 grads, the root's bf16 + fp32
    else:
        working = 2 * n  # autocast's bf16 copies of the weights
    ac = train_cfg.activation_checkpointing
    tokens = train_cfg.micro_batch * s["T"]
    per_block = s["act"][ac]
    activations = tokens * (s["L"] * per_block + (s["act"]["none"] if ac == "full" else 0) + 2 * s["V"])
    return Plan(
        params=4 * n // shards,
        grads=4 * n // shards,
        optimizer=8 * n // shards,
        working=working,
        activations=activations,
        device_bytes=device_bytes,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        world=world,
        n_vocab=n_vocab,
    )


def _with(plan: Plan, world: int | None = None, **train) -> Plan:
    return estimate(
        plan.model_cfg, plan.train_cfg.model_copy(update=train), world or plan.world, plan.device_bytes, plan.n_vocab
    )


def alternatives(plan: Plan) -> list[str]:
    """The single changes (or the smallest pairs) under which the step fits, as `--set` assignments."""
    t, out = plan.train_cfg, []
    if t.parallel == "ddp" and _with(plan, parallel="fsdp").fits:
        out.append("train.parallel=fsdp")
    for ac in ("selective", "full"):
        if t.activation_checkpointing != ac and (ac == "full" or t.activation_checkpointing == "none"):
            if _with(plan, activation_checkpointing=ac).fits:
                out.append(f"train.activation_checkpointing={ac}")
                break
            if t.parallel == "ddp" and _with(plan, parallel="fsdp", activation_checkpointing=ac).fits:
                out.append(f"train.parallel=fsdp with train.activation_checkpointing={ac}")
                break
    mb = t.micro_batch // 2
    while mb >= 1 and not _with(plan, micro_batch=mb).fits:
        mb //= 2
    if mb >= 1:
        out.append(f"train.micro_batch={mb} (batch_tokens stays, accumulation grows)")
    world = plan.world * 2
    while world <= 1024 and not _with(plan, world, parallel="fsdp").fits:
        world *= 2
    if world <= 1024 and t.parallel == "fsdp":
        out.append(f"{world} GPUs")
    elif world <= 1024 and not out:
        out.append(f"{world} GPUs with train.parallel=fsdp")
    return out


def check(plan: Plan) -> Plan:
    """The plan when it fits; else a UserError naming the estimate and what would fit."""
    if plan.fits:
        return plan
    t = plan.train_cfg
    options = alternatives(plan)
    what = (
        f"{plan.model_cfg.preset or 'the model'} with train.parallel={t.parallel}, "
        f"activation_checkpointing={t.activation_checkpointing}, micro_batch={t.micro_batch} on {plan.world} GPU(s)"
    )
    fix = (
        ("; it would fit with " + " or ".join(options))
        if options
        else "; nothing tried fits (fsdp, activation checkpointing, micro_batch 1, up to 1024 GPUs): choose a smaller model"
    )
    raise UserError(f"{what} will not fit: {plan.summary()}{fix}")
