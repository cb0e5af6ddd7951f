"""Memory planning before the first step: what each GPU will hold, and what to change when it will not fit.

    plan = estimate(model_cfg, train_cfg, world, device_bytes)   per GPU, in bytes: params, grads, optimizer,
                                                                 working copies, activations, reserve
    check(plan)           a UserError naming the changes that would fit
    resolve(...)          train.activation_checkpointing=auto: the lightest policy whose plan fits
    settle_reshard(...)   train.fsdp_reshard_after_forward=auto: kept gathered where that still fits

Design notes: docs/models.md, `lmyard/train/distributed/memory.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from lmyard.config import ModelConfig, RunConfig, TrainConfig
from lmyard.errors import UserError
from lmyard.models import registry

GIB = 2**30
RESERVE = 0.10
EXPANDABLE = "expandable_segments:True"
LADDER = ("pointwise", "selective", "full")  # the checkpointing modes heavier than none, lightest first


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
    grads_at_peak: bool = True
    """False under fsdp without accumulation: the gradients come as the activations go (module docstring)."""

    @property
    def total(self) -> int:
        peak = self.grads + self.activations if self.grads_at_peak else max(self.grads, self.activations)
        return self.params + self.optimizer + self.working + peak

    @property
    def usable(self) -> int:
        return int(self.device_bytes * (1 - RESERVE))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def summary(self) -> str:
        later = {"grads": "" if self.grads_at_peak else " made as the activations are freed"}
        parts = ", ".join(
            f"{k} {getattr(self, k) / GIB:.1f}{later.get(k, '')}"
            for k in ("params", "grads", "optimizer", "working", "activations")
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
        "compiled": t.compiled,
    }


def _kept_per_token(s: dict, train_cfg: TrainConfig) -> int:
    """Bytes the blocks keep for backward per token (the module docstring's activations, without the logits)."""
    ac, L = train_cfg.activation_checkpointing, s["L"]
    assert ac != "auto", "estimate() settles auto before the activations are counted"
    act = s["act"] | s["compiled"] if train_cfg.compile is not False else s["act"]  # None: on, on a GPU
    if ac == "none":
        return L * act["none"]
    n = min(train_cfg.activation_checkpointing_blocks or L, L)
    kept = n * act[ac] + (L - n) * act["none"]
    return kept + act["none"] if ac == "full" else kept  # full: + the one block being recomputed


def n_layer(model_cfg: ModelConfig, n_vocab: int = 50257) -> int:
    return _shape(model_cfg, n_vocab)["L"]


def estimate(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world: int, device_bytes: int, n_vocab: int = 50257
) -> Plan:
    """Per-GPU bytes of a training step (see the module docstring); n_vocab: the tokenizer's, for models
    whose vocab_size is not fixed by the config. An `auto` (checkpointing, resharding): the plan of what it chooses."""
    if "auto" in (train_cfg.activation_checkpointing, train_cfg.fsdp_reshard_after_forward):
        settled, _ = resolve(model_cfg, train_cfg, world, device_bytes, n_vocab)
        return estimate(model_cfg, settled, world, device_bytes, n_vocab)
    s = _shape(model_cfg, n_vocab)
    fsdp = train_cfg.parallel == "fsdp"
    shards = world if fsdp else 1
    n = s["n"]
    if fsdp:
        gathered = 2 * s["block"] * (s["L"] if train_cfg.fsdp_reshard_after_forward is False else 2)  # auto: as true
        working = gathered + 4 * s["block"] + 6 * s["root"]  # + a block's fp32 grads, the root's bf16 + fp32
    else:
        working = 2 * n  # autocast's bf16 copies of the weights
    tokens = train_cfg.micro_batch * s["T"]
    activations = tokens * (_kept_per_token(s, train_cfg) + 2 * s["V"])
    accumulates = train_cfg.batch_tokens > tokens * world  # more than one micro-step per optimizer step
    low = fsdp and train_cfg.fsdp_param_dtype == "bfloat16"  # bf16 shards, fp32 masters in the optimizer
    return Plan(
        params=(2 if low else 4) * n // shards,
        grads=(2 if low else 4) * n // shards,
        optimizer=(12 if low else 8) * n // shards,
        working=working,
        activations=activations,
        device_bytes=device_bytes,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        world=world,
        n_vocab=n_vocab,
        grads_at_peak=accumulates or not fsdp,
    )


def use_expandable_segments() -> None:
    """Before the first CUDA allocation: the caching allocator grows its segments in place (PyTorch's
    expandable_segments, as torchtitan launches), so memory freed by one shape serves the next instead of
    fragmenting (at 8B with fixed segments, 12.8 GiB reserved over the 56.6 GiB allocated; the plan's 10%
    reserve is for that gap, docs/history/benchmarks-log.md has what is left of it). A PYTORCH_CUDA_ALLOC_CONF already
    set is left as it is."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    import torch

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE  # for processes this one starts
    # this process, where torch may have read the variable already (torch 2.11 renamed the setter)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(EXPANDABLE)


def _with(plan: Plan, world: int | None = None, **train: Any) -> Plan:
    return estimate(
        plan.model_cfg, plan.train_cfg.model_copy(update=train), world or plan.world, plan.device_bytes, plan.n_vocab
    )


def _fewest_blocks(plan: Plan, mode: str, **train: Any) -> Plan | None:
    """The plan of `mode` (one of LADDER) checkpointing on the fewest first blocks (fewer than all) that fits,
    else None. Each block checkpointed saves the same bytes, so the first n that fits is the lightest."""
    L = n_layer(plan.model_cfg, plan.n_vocab)
    for n in range(1, L):
        first_n = _with(plan, activation_checkpointing=mode, activation_checkpointing_blocks=n, **train)
        if first_n.fits:
            return first_n
    return None


def _ladder(plan: Plan, **train: Any) -> list[Callable[[], Plan | None]]:
    """The checkpointing heavier than none, lightest first (the module docstring's order), each step planned
    when called: for each of LADDER's modes, that mode on the fewest first blocks, then on every block. A
    partial step plans None where no n < L fits; the steps alternate partial (even) and every block (odd)."""
    every = {"activation_checkpointing_blocks": None}
    return [
        step
        for mode in LADDER
        for step in (
            partial(_fewest_blocks, plan, mode, **train),
            partial(_with, plan, activation_checkpointing=mode, **every, **train),
        )
    ]


def describe(train_cfg: TrainConfig, L: int) -> str:
    """The checkpointing of a resolved train config in words: `none`, `pointwise on 20 of 32 blocks`,
    `selective`, `full on 12 of 32 blocks`, `full on all 32 blocks`."""
    ac, n = train_cfg.activation_checkpointing, train_cfg.activation_checkpointing_blocks
    if ac in LADDER and n is not None and n < L:
        return f"{ac} on {n} of {L} blocks"
    return f"full on all {L} blocks" if ac == "full" else ac


def _checkpointing_alternative(plan: Plan) -> str | None:
    """The lightest checkpointing heavier than the plan's that fits, as `--set` assignments (with fsdp under ddp
    when only that fits)."""
    t, L = plan.train_cfg, n_layer(plan.model_cfg, plan.n_vocab)
    # where the plan's own step sits on the ladder; a partial step's fewest blocks that fit are more than its own
    every = (t.activation_checkpointing_blocks or L) >= L
    ac = t.activation_checkpointing
    start = 0 if ac == "none" else 2 * LADDER.index(ac) + (2 if every else 0)
    extras: list[dict[str, Any]] = [{}, {"parallel": "fsdp"}] if t.parallel == "ddp" else [{}]
    for extra in extras:
        fit = next((c for step in _ladder(plan, **extra)[start:] if (c := step()) is not None and c.fits), None)
        if fit is not None:
            ct = fit.train_cfg
            sets = f"train.activation_checkpointing={ct.activation_checkpointing}"
            if ct.activation_checkpointing_blocks is not None:
                sets += f" with train.activation_checkpointing_blocks={ct.activation_checkpointing_blocks}"
            return f"train.parallel=fsdp with {sets}" if extra else sets
    return None


def alternatives(plan: Plan) -> list[str]:
    """The single changes (or the smallest pairs) under which the step fits, as `--set` assignments."""
    t, out = plan.train_cfg, []
    if t.parallel == "ddp" and _with(plan, parallel="fsdp").fits:
        out.append("train.parallel=fsdp")
    if (ac := _checkpointing_alternative(plan)) is not None:
        out.append(ac)
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
    ac = describe(t, n_layer(plan.model_cfg, plan.n_vocab))
    what = (
        f"{plan.model_cfg.preset or 'the model'} with train.parallel={t.parallel}, "
        f"activation_checkpointing={ac}, micro_batch={t.micro_batch} on {plan.world} GPU(s)"
    )
    fix = (
        ("; it would fit with " + " or ".join(options))
        if options
        else "; nothing tried fits (fsdp, activation checkpointing, micro_batch 1, up to 1024 GPUs): choose a smaller model"
    )
    raise UserError(f"{what} will not fit: {plan.summary()}{fix}")


def _gib(plan: Plan) -> str:
    return f"{plan.total / GIB:.1f} GiB"


def choose(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world: int, device_bytes: int, n_vocab: int = 50257
) -> tuple[Plan, str]:
    """For activation_checkpointing=auto: the plan of the lightest checkpointing that fits (module docstring),
    full on every block when none does (check() then names what would), and the startup line saying why."""
    resharded = train_cfg.fsdp_reshard_after_forward is not False  # auto: settled after the checkpointing
    base = train_cfg.model_copy(update={"activation_checkpointing": "none", "fsdp_reshard_after_forward": resharded})
    none = estimate(model_cfg, base, world, device_bytes, n_vocab)
    L, tried, steps = n_layer(model_cfg, n_vocab), [none], _ladder(none)
    short: Plan | None = None  # a partial step that nothing fits: its most blocks short of all
    for i, step in enumerate(steps):
        if tried[-1].fits:
            break
        plan = step()
        if plan is None:
            mode = LADDER[i // 2]
            short = _with(none, activation_checkpointing=mode, activation_checkpointing_blocks=L - 1) if L > 1 else None
            continue
        chosen_here = plan.fits or i == len(steps) - 1
        tried += [short, plan] if short is not None and chosen_here else [plan]  # short says why every block
        short = None
    chosen = tried[-1]
    why = f"plan {_gib(chosen)} of {chosen.usable / GIB:.1f} GiB usable per GPU" + "".join(
        f"; {describe(p.train_cfg, L)} would need {_gib(p)}" for p in tried[:-1]
    )
    return chosen, f"activation checkpointing: {describe(chosen.train_cfg, L)} ({why})"


def resolve(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world: int, device_bytes: int | None, n_vocab: int = 50257
) -> tuple[TrainConfig, str | None]:
    """The train config with its checkpointing and fsdp resharding settled, and the startup lines when auto
    chose them on a GPU. device_bytes None (no GPU): checkpointing auto is none, resharding true, there is
    nothing to plan against. A UserError when the blocks exceed the model's (a config validator checks this
    too, but not against an init_from model's sizes)."""
    L = n_layer(model_cfg, n_vocab)
    blocks = train_cfg.activation_checkpointing_blocks
    if blocks is not None and blocks > L:
        raise UserError(
            f"train.activation_checkpointing_blocks is {blocks} but the model has {L} blocks: set at most {L}"
        )
    line = None
    if train_cfg.activation_checkpointing == "auto":
        if device_bytes is None:  # silent: on CPU nothing is planned, and the smoke run's output stays as it was
            train_cfg = train_cfg.model_copy(update={"activation_checkpointing": "none"})
        else:
            plan, line = choose(model_cfg, train_cfg, world, device_bytes, n_vocab)
            train_cfg = plan.train_cfg.model_copy(
                update={"fsdp_reshard_after_forward": train_cfg.fsdp_reshard_after_forward}
            )
    train_cfg, kept = settle_reshard(model_cfg, train_cfg, world, device_bytes, n_vocab)
    return train_cfg, "\n".join(x for x in (line, kept) if x) or None


def settle_reshard(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world: int, device_bytes: int | None, n_vocab: int = 50257
) -> tuple[TrainConfig, str | None]:
    """train.fsdp_reshard_after_forward=auto, after the checkpointing is settled: false (every block stays
    gathered from its forward to its backward, one all-gather a block instead of two) where that plan fits,
    else true; with the startup line saying which. true under ddp (unused there) and on CPU, silently."""
    if train_cfg.fsdp_reshard_after_forward != "auto":
        return train_cfg, None
    resharded = train_cfg.model_copy(update={"fsdp_reshard_after_forward": True})
    if train_cfg.parallel != "fsdp" or device_bytes is None:
        return resharded, None
    kept = estimate(
        model_cfg, train_cfg.model_copy(update={"fsdp_reshard_after_forward": False}), world, device_bytes, n_vocab
    )
    if kept.fits:
        why = f"plan {_gib(kept)} of {kept.usable / GIB:.1f} GiB usable per GPU"
        return kept.train_cfg, f"fsdp: every block stays gathered from its forward to its backward ({why})"
    plan = estimate(model_cfg, resharded, world, device_bytes, n_vocab)
    return resharded, (
        f"fsdp: each block resharded after its forward, gathered again for backward (plan {_gib(plan)}; keeping "
        f"them gathered would need {_gib(kept)} of {kept.usable / GIB:.1f} GiB usable per GPU)"
    )


def plan_memory(cfg: RunConfig, n_vocab: int, d) -> RunConfig:
    """Before the first step: the config with train.activation_checkpointing settled (auto: the lightest that
    fits, said in one line) and, on a GPU, each GPU's parameters, gradients, optimizer state and activations;
    a UserError naming what would fit (fsdp, activation checkpointing, a smaller micro-batch, more GPUs) when
    they will not. `d`: this rank (lmyard.train.distributed.group.Dist: world, device, is_main)."""
    import torch

    cuda = d.device.type == "cuda"
    total = torch.cuda.get_device_properties(d.device).total_memory if cuda else None
    train, line = resolve(cfg.model, cfg.train, d.world, total, n_vocab)
    if d.is_main and line:
        print(line, flush=True)
    if total is not None:
        plan = check(estimate(cfg.model, train, d.world, total, n_vocab))
        if d.is_main:
            print(f"memory plan per GPU: {plan.summary()}", flush=True)
    return cfg.model_copy(update={"train": train})
