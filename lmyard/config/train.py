"""The `train` section and its `guard`: the optimizer, the schedule, parallelism, precision and the divergence guard."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmyard.config.base import _Section


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
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (AdamW's).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final lr as a fraction of the peak (the end of the cosine or wsd decay)."
    )
    warmup_steps: int = Field(40, ge=0)
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine",
        description="The lr after warmup. `cosine`: decays from the peak to lr * min_lr_ratio at max_steps. `wsd` "
        "(warmup-stable-decay): holds the peak, then decays linearly to lr * min_lr_ratio over the last "
        "train.decay_fraction of max_steps, so a lineage can be extended or stopped early by moving max_steps "
        "before its decay starts.",
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: the fraction of max_steps (after warmup) the final decay takes."
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="`adamw`: AdamW for every parameter. `muon`: torch.optim.Muon (Newton-Schulz orthogonalised "
        "momentum) for the blocks' matrices, AdamW (train.lr, betas, weight_decay) for the embeddings, the output "
        "head, norms and biases (lmyard.train.muon). Needs train.parallel=ddp.",
    )
    muon_lr: float = Field(
        0.02,
        gt=0,
        description="muon: peak lr of the hidden matrices (scaled by sqrt(max(1, rows/cols)), Keller Jordan's rule; "
        "follows train.schedule). Provisional: Muon's reference value for GPT-2, not yet measured here.",
    )
    muon_momentum: float = Field(0.95, gt=0, lt=1, description="muon: Nesterov momentum of the hidden matrices.")
    muon_weight_decay: float = Field(0.0, ge=0, description="muon: decoupled decay of the hidden matrices.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay, applied to matrices only.")
    beta1: float = Field(0.9, gt=0, lt=1)
    beta2: float = Field(0.95, gt=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    seed: int = 1337
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto`: CUDA when present.")
    compile: bool | None = Field(None, description="torch.compile the model; default: on for CUDA.")
    compile_scope: Literal["model", "blocks"] = Field(
        "model",
        description="What train.compile compiles without FSDP (one device, DDP): `model`, one graph of the whole "
        "model; `blocks`, each block on its own, as train.parallel=fsdp always does (one block's compiled code "
        "serves every block of its shape: a first step several times shorter, docs/performance.md).",
    )
    compile_cache: bool = Field(
        True,
        description="Save torch.compile's cache artifacts to the run's store after an attempt's first compile and "
        "load them before every later attempt's first step, on any node, and in every lineage of that store with the "
        "same key (compile/; code the first step runs: read only from the run's own store).",
    )
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
    fsdp_reshard_after_forward: bool | Literal["auto"] = Field(
        "auto",
        description="fsdp: true frees each block's gathered parameters after its forward (gathered again for "
        "backward); false keeps them until backward: one all-gather a block instead of two, more memory; `auto`: "
        "before the first step, false where the memory plan fits with it once checkpointing is settled, else true "
        "(true on CPU).",
    )

    @field_validator("fsdp_reshard_after_forward", mode="before")
    @classmethod
    def _reshard_is_bool_or_auto(cls, v: Any) -> Any:
        """One message for a bad value (the union's two members would each report theirs)."""
        if isinstance(v, bool) or v == "auto":
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError(f"should be true, false or auto, got {v!r}")

    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="fsdp on CUDA: the dtype gradients are reduce-scattered in; bfloat16 halves the bytes sent "
        "(faster where the interconnect is short) at the cost of rounding each rank's gradient before the sum. "
        "The sharded gradients stay float32 (bf16 with train.fsdp_param_dtype=bfloat16).",
    )
    fsdp_param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="fsdp: the dtype of the sharded parameters. bfloat16: the shards and their gradients are "
        "bf16 and AdamW keeps float32 master weights and moments (started from the float32 initial weights), "
        "so on CUDA FSDP2 casts nothing around its all-gathers and reduce-scatters (faster); the updates are "
        "those of float32 parameters given the same bf16 gradients. A checkpoint holds the bf16 weights, and "
        "the masters in the optimizer's state.",
    )
    fsdp_embedding: Literal["auto", "gathered", "sharded"] = Field(
        "auto",
        description="fsdp: how an untied input token table is looked up. `gathered`: FSDP2 gathers the whole "
        "table for the lookup and reduce-scatters its whole gradient; `sharded`: the table stays in its row "
        "shards, each rank looks up every rank's tokens in its own rows and the looked-up rows are "
        "reduce-scattered (their gradients all-gathered), moving world x tokens rows instead of the table's; "
        "`auto`: sharded on two ranks or more where world x micro_batch x block_size is at most the table's rows.",
    )
    fsdp_copies: Literal["auto", "compute", "side"] = Field(
        "auto",
        description="fsdp on CUDA: how FSDP2's layout copies run: the shards into each all-gather's buffer, its "
        "split into the parameters, the gradients into each reduce-scatter's buffer. `compute`: as FSDP2 ships, "
        "kernels, the split and the cat on the compute stream; `side`: memcpys on the copy engines, on FSDP2's "
        "side streams, beside the matmuls (each block's parameters are then allocated while the block before "
        "computes: one gathered block more); `auto`: side on two ranks or more for blocks of 150M parameters or "
        "more (Llama-3 8B's: faster there, slower at llama-1b's 60M) where this torch's FSDP2 allows it "
        "(lmyard.train.distributed.fsdp_copies).",
    )
    fsdp_all_gather: Literal["auto", "nccl", "copy_engine"] = Field(
        "auto",
        description="fsdp on CUDA: how each block's parameters are gathered. `copy_engine`: into NCCL symmetric "
        "memory, where NCCL's copy engines move them and leave every SM to the matmuls (all ranks on one host, "
        "NCCL 2.28+, torch 2.11+); `nccl`: NCCL's all-gather kernels in ordinary memory; `auto`: copy_engine "
        "where it can run, else nccl.",
    )
    residual_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The dtype of the residual stream between blocks on CUDA. ddp (bf16 autocast, float32 "
        "weights): `float32` (as nanoGPT) or `bfloat16` (as Megatron and FSDP2's bf16 weights carry it: half the "
        "bytes through every norm, add and cast; GPT-2 124M 5.5% faster on an H100); fsdp: bfloat16 only. `auto`: "
        "float32 under ddp, bfloat16 under fsdp. On CPU the model runs in float32.",
    )
    activation_checkpointing: Literal["auto", "none", "pointwise", "selective", "full"] = Field(
        "auto",
        description="Recompute activations in backward instead of keeping them: `full` recomputes every "
        "block; `selective` keeps matmul and attention outputs except every second matmul's (torchtitan's "
        "op-level policy); `pointwise` keeps every matmul's and attention's output and recomputes only the "
        "elementwise ops (norms, RoPE, SwiGLU's product); each on the first train.activation_checkpointing_blocks "
        "only; `auto`: before the first step, the lightest that the memory plan fits on the GPU, in order none, "
        "pointwise on the fewest first blocks, pointwise on every block, selective on the fewest first blocks, "
        "selective on every block, full on the fewest first blocks, full on every block (none on CPU).",
    )
    activation_checkpointing_blocks: int | None = Field(
        None,
        gt=0,
        description="With activation_checkpointing=pointwise, selective or full: checkpoint only the first N "
        "blocks (the rest keep all their activations); default every block.",
    )
    float8: bool = Field(
        False,
        description="torchao float8 linears in the blocks (GPUs of compute capability 8.9+ "
        "with torchao installed; otherwise skipped with a warning).",
    )
    float8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="train.float8's torchao scaling recipe: `tensorwise` (one scale per tensor: fastest) or "
        "`rowwise` (one scale per row: closer to bf16's loss, a little slower).",
    )
    guard: GuardConfig = Field(default_factory=GuardConfig)

    @model_validator(mode="after")
    def _residual_under_fsdp(self) -> TrainConfig:
        if self.parallel == "fsdp" and self.residual_dtype == "float32":
            raise ValueError(
                "train.residual_dtype=float32 needs train.parallel=ddp: FSDP2's bf16 weights carry the residual "
                "stream in bfloat16; set train.residual_dtype=auto or bfloat16, or train.parallel=ddp"
            )
        return self

    @model_validator(mode="after")
    def _muon_under_ddp(self) -> TrainConfig:
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ValueError(
                "train.optimizer=muon needs train.parallel=ddp: Muon orthogonalises each whole matrix and FSDP2 "
                "holds row shards (gathering them every step is not built); set train.parallel=ddp or "
                "train.optimizer=adamw"
            )
        return self

    @model_validator(mode="after")
    def _checkpointing_blocks(self) -> TrainConfig:
        if self.activation_checkpointing_blocks is not None and self.activation_checkpointing in ("none", "auto"):
            raise ValueError(
                f"train.activation_checkpointing_blocks applies to activation_checkpointing=pointwise, selective or "
                f"full, not {self.activation_checkpointing}: set one of them, or unset the blocks"
            )
        return self
