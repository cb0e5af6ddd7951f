"""Sharded data parallelism and its companions, for models with a `layers` ModuleList of blocks.

`parallelize(raw_model, cfg, world, device)` gives the model to train under `train.parallel=fsdp`,
applying, in torchtitan's order: float8 linears -> activation checkpointing -> torch.compile per block
-> FSDP2 (`fully_shard` per block, the embeddings, the final norm with the head, then the root).

Design notes: docs/models.md, `lmyard/train/distributed/parallel.py`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from lmyard.config import RunConfig, TrainConfig
from lmyard.errors import UserError
from lmyard.models import registry
from lmyard.train.distributed.fsdp_copies import missing as copies_missing
from lmyard.train.distributed.fsdp_copies import move_off_compute
from lmyard.train.distributed.sharded_embedding import shard_rows, sharded_pays


def _blocks(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList of blocks to wrap one by one")
    return layers


def apply_float8(model: nn.Module, device: torch.device, recipe: str = "tensorwise") -> bool:
    """Swap the blocks' linears for torchao's float8 training linears (`recipe`: tensorwise or rowwise scaling,
    torchao's recipes); False, with a warning, where torchao is missing or the device has no float8 matmuls
    (CUDA compute capability < 8.9)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        warnings.warn(
            "train.float8 skipped: float8 matmuls need a CUDA GPU of compute capability 8.9+ (H100, L40S)", stacklevel=2
        )
        return False
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        warnings.warn("train.float8 skipped: torchao is not installed (pip install torchao)", stacklevel=2)
        return False

    def dims_ok(module: nn.Module, fqn: str) -> bool:  # float8 GEMMs need both sizes divisible by 16
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    if recipe == "rowwise":  # as torchtitan does: inductor's casts otherwise lose precision (pytorch#150859)
        from torch._inductor import config as inductor_config

        inductor_config.emulate_precision_casts = True
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(_blocks(model), config=config, module_filter_fn=dims_ok)
    return True


def _selective_policy(every_matmul: bool = False):
    """torchtitan's op-level SAC policy: keep matmul/attention outputs, except every second matmul's (every
    matmul's: `pointwise`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    mm_ops = {aten.mm.default, aten.linear.default}
    keep = mm_ops | {
        getattr(aten, name).default
        for name in (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
        if hasattr(aten, name)
    }
    keep.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    keep.add(torch.ops.higher_order.flex_attention)  # model.doc_mask's attention (lmyard.models.attention)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in mm_ops:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            if counts[mode] % 2 == 0 and not every_matmul:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str, blocks: int | None = None) -> None:
    """Wrap blocks for recomputation in backward: `none`, `pointwise`, `selective` or `full` (see the module
    docstring); `blocks`: only the first so many, in any mode (default every block). The wrapper keeps the
    blocks' state_dict keys (checkpoint_wrapper strips its own prefix)."""
    if mode == "none":
        return
    if mode not in ("pointwise", "selective", "full"):
        raise ValueError(
            f"activation checkpointing mode {mode!r}: choose none, pointwise, selective or full (auto is resolved "
            "before)"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

    layers = _blocks(model)
    if blocks is not None and not 0 < blocks <= len(layers):
        raise ValueError(f"{blocks} blocks of {mode} checkpointing: give 1 to {len(layers)}")

    def by_op():  # a fresh policy per forward: it counts the matmuls it has seen
        return create_selective_checkpoint_contexts(_selective_policy(every_matmul=mode == "pointwise"))

    context_fn = noop_context_fn if mode == "full" else by_op  # noop: torch's default, the whole block
    for i, block in enumerate(layers[:blocks] if blocks is not None else layers):
        if mode != "full":
            _plain_ops(block)
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)


def _plain_ops(block: nn.Module) -> None:
    """Selective checkpointing saves matmul outputs by their op (aten.mm): a fused op (GPT-2's MLP,
    lmyard.models.mlp) hides its products from the policy and would be recomputed whole, so the block's
    modules that offer one (an `epilogues` attribute) keep their plain ops."""
    for module in block.modules():
        if hasattr(module, "epilogues"):
            module.epilogues = False  # type: ignore[assignment]  # a plain attribute, as GPT-2 declares it


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block in place (fullgraph): one compiled graph reused by every block of one shape,
    and the parameter names stay as they are."""
    for block in _blocks(model):
        block.compile(fullgraph=True)


def mixed_precision(device: torch.device, reduce_dtype: str = "float32"):
    """bf16 compute with gradients reduced in `reduce_dtype` (train.fsdp_reduce_dtype) on CUDA; fp32 on CPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type == "cuda":
        reduce = getattr(torch, reduce_dtype)
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce, cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(
    model: nn.Module,
    mesh,
    device: torch.device,
    reshard_after_forward: bool = True,
    reduce_dtype: str = "float32",
    all_gather: str = "nccl",
    param_dtype: str = "float32",
    embedding: str = "gathered",
    tokens_per_rank: int = 0,
    copies: str = "compute",
) -> nn.Module:
    """FSDP2: `fully_shard` the family's own units (its spec's `fsdp_units`: Llama's embeddings, and its final
    norm with the head), then each block, then the root with what is left (GPT-2's tied table and head).
    `mesh` is a 1-D DeviceMesh of the data-parallel ranks (fsdp_mesh); `all_gather` is all_gather_mode's;
    `param_dtype` bfloat16: the shards are bf16, their fp32 masters handed to the optimizer (keep_masters);
    `embedding` (train.fsdp_embedding) sharded, or auto where it pays for `tokens_per_rank` tokens a micro-step:
    a unit that is one untied nn.Embedding is looked up in its row shards instead (lmyard.train.
    sharded_embedding); `copies` side: FSDP2's copy-in, split and cat as memcpys on the copy engines, on its side
    streams (lmyard.train.distributed.fsdp_copies)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    masters = round_to_bf16(model, mesh) if param_dtype == "bfloat16" else []
    shard = partial(fully_shard, mesh=mesh, mp_policy=mixed_precision(device, reduce_dtype))
    ignored: set[nn.Parameter] = set()
    for modules, reshard in registry.spec_of(model).fsdp_units(model):
        if _untied_embedding(model, modules) and (
            embedding == "sharded"
            or embedding == "auto"
            and sharded_pays(mesh.size(), tokens_per_rank, modules[0].weight.shape[0])
        ):
            ignored.add(shard_rows(modules[0], mesh, mixed_precision(device).param_dtype, device))
            continue
        shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard and reshard_after_forward)
    for block in _blocks(model):
        shard(block, reshard_after_forward=reshard_after_forward)
    # the root, which FSDP2 keeps gathered for backward; a table in row shards is none of FSDP2's parameters
    shard(model, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)
    keep_masters(masters)
    if all_gather == "copy_engine":
        comm = symmetric_all_gather(mesh.get_group())
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            unit.set_custom_all_gather(comm)
    if copies == "side":
        move_off_compute(model, list(_blocks(model)))
    return model


def block_params(model: nn.Module) -> int:
    """Parameters in the model's first block (its blocks are alike)."""
    return sum(p.numel() for p in _blocks(model)[0].parameters())


def _untied_embedding(model: nn.Module, modules: list[nn.Module]) -> bool:
    """Whether a family's FSDP unit is one nn.Embedding whose table no other module shares."""
    if len(modules) != 1 or not isinstance(modules[0], nn.Embedding):
        return False
    table = modules[0].weight
    return sum(p is table for _, p in model.named_parameters(remove_duplicate=False)) == 1


def round_to_bf16(model: nn.Module, mesh) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Round the model's fp32 parameters to bf16 in place, before FSDP2 shards them, keeping this rank's fp32
    part of each (its dim-0 chunk, as FSDP2's Shard(0) cuts it) as (module, name, part). A tied parameter
    is rounded and kept once."""
    rank, world = mesh.get_local_rank(), mesh.size()
    kept, seen = [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or p.dtype != torch.float32:
                continue
            seen.add(id(p))
            chunks = torch.chunk(p.detach(), world, dim=0)
            kept.append((module, name, chunks[rank].clone() if rank < len(chunks) else p.new_empty(0)))
            p.data = p.data.to(torch.bfloat16)
    return kept


def keep_masters(masters: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Hand each sharded bf16 parameter its fp32 part (round_to_bf16's) as a DTensor of the same sharding,
    for the optimizer's master weights (lmyard.train.optim.keep_master)."""
    from torch.distributed.tensor import DTensor

    from lmyard.train.optim import keep_master

    for module, name, part in masters:
        p = getattr(module, name)  # FSDP2's sharded parameter
        local = part.view(p.to_local().shape)
        keep_master(p, DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()))


def all_gather_mode(t: TrainConfig, device: torch.device, world: int, local_world: int) -> str:
    """train.fsdp_all_gather settled for this run: `copy_engine` or `nccl` (also under ddp, which gathers
    nothing). `copy_engine` asked for where it cannot run is a UserError that names what is missing."""
    if t.parallel != "fsdp" or t.fsdp_all_gather == "nccl":
        return "nccl"
    missing = _copy_engine_missing(device, world, local_world)
    if missing and t.fsdp_all_gather == "copy_engine":
        raise UserError(f"train.fsdp_all_gather=copy_engine needs {missing}; set train.fsdp_all_gather=auto or nccl")
    return "nccl" if missing else "copy_engine"


def _copy_engine_missing(device: torch.device, world: int, local_world: int) -> str | None:
    if device.type != "cuda":
        return "a CUDA device, and this run is on the CPU"
    if world < 2:
        return "two or more ranks, and this run has one"
    if world != local_world:
        return f"every rank on one host, and this run has {world} ranks with {local_world} on this host"
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else (0,)
    if nccl < (2, 28):
        return f"NCCL 2.28 or later, and this torch has NCCL {'.'.join(map(str, nccl))}"
    if not hasattr(getattr(dist, "ProcessGroupNCCL", None), "NCCL_CTA_POLICY_ZERO"):
        return f"torch 2.11 or later (NCCL's zero-CTA policy), and this is torch {torch.__version__}"
    return None


SIDE_COPIES_FROM = 150_000_000  # parameters a block: side measured faster at 218M (8B), slower at 60M (llama-1b)


def copies_mode(t: TrainConfig, device: torch.device, world: int, block_params: int) -> str:
    """train.fsdp_copies settled for this run: `side` or `compute` (also under ddp, which copies nothing).
    auto takes side for blocks of SIDE_COPIES_FROM parameters or more, where the copies outweigh what their
    launches cost. `side` asked for where it cannot run is a UserError that names what is missing."""
    if t.parallel != "fsdp" or t.fsdp_copies == "compute":
        return "compute"
    lacks = "a CUDA device" if device.type != "cuda" else "two or more ranks" if world < 2 else copies_missing()
    if lacks and t.fsdp_copies == "side":
        raise UserError(f"train.fsdp_copies=side needs {lacks}; set train.fsdp_copies=auto or compute")
    return "compute" if lacks or t.fsdp_copies == "auto" and block_params < SIDE_COPIES_FROM else "side"


def init_process_group(t: TrainConfig, device: torch.device, world: int, local_world: int) -> str:
    """Settle train.fsdp_all_gather (all_gather_mode: a copy_engine, or a side train.fsdp_copies, that cannot run
    stops here, before the model is built) and, on several
    ranks, make the default process group: NCCL with that mode's options on CUDA, gloo on CPU. Returns the mode."""
    gather = all_gather_mode(t, device, world, local_world)
    copies_mode(t, device, world, block_params=0)  # a train.fsdp_copies=side that cannot run stops here too
    if world > 1:
        cuda = device.type == "cuda"
        options = process_group_options(gather) if cuda else None
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, pg_options=options)
    return gather


def process_group_options(mode: str):
    """init_process_group's pg_options for an all-gather mode: copy_engine's communicator takes NCCL's
    zero-CTA policy (the copy engines wherever a buffer is symmetric, kernels elsewhere); None: NCCL's defaults."""
    if mode != "copy_engine":
        return None
    options = dist.ProcessGroupNCCL.Options()
    # torch's stubs lack both names
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO  # type: ignore[attr-defined]
    return options


def symmetric_all_gather(group):
    """FSDP2's all-gather through its custom-comm hook (set_custom_all_gather), with each output buffer taken
    from torch's NCCL symmetric-memory pool and registered with every rank (rendezvous) before NCCL fills it."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class SymmetricAllGather(AllGather):
        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            symm_mem.rendezvous(output_tensor, group=group.group_name)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    symm_mem.set_backend("NCCL")
    dist.barrier(group=group)  # every rank's communicator is up before the first rendezvous
    return SymmetricAllGather()


def fsdp_mesh(world: int, device: torch.device):
    """The 1-D mesh of all ranks; a 1-rank process group is made in process when none exists (one GPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError("fsdp on several ranks needs torch.distributed initialised first (torchrun)")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    return init_device_mesh(device.type, (world,))


def parallelize(raw_model: nn.Module, cfg: RunConfig, world: int, device: torch.device) -> nn.Module:
    """The model to train under train.parallel=fsdp: float8 (train.float8) -> activation checkpointing
    (train.activation_checkpointing, resolved: not auto; lmyard.train.distributed.memory.resolve) -> torch.compile per block (train.compile; default on CUDA) -> FSDP2
    (train.fsdp_reshard_after_forward, train.fsdp_reduce_dtype, train.fsdp_all_gather, train.fsdp_param_dtype). Modifies and returns raw_model; its parameters become DTensor shards
    on `device`, so build the optimizer after this call."""
    t = cfg.train
    if t.float8:
        apply_float8(raw_model, device, t.float8_recipe)
    apply_activation_checkpointing(raw_model, t.activation_checkpointing, t.activation_checkpointing_blocks)
    if t.compile if t.compile is not None else device.type == "cuda":
        compile_blocks(raw_model)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    mesh = fsdp_mesh(world, device)
    reshard = t.fsdp_reshard_after_forward is not False  # auto unsettled (no memory plan ran): as true
    gather = all_gather_mode(t, device, world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return apply_fsdp(
        raw_model,
        mesh,
        device,
        reshard,
        t.fsdp_reduce_dtype,
        gather,
        t.fsdp_param_dtype,
        t.fsdp_embedding,
        t.micro_batch * registry.model_spec(raw_model)["block_size"],
        copies_mode(t, device, world, block_params(raw_model)),
    )


def no_sync(model: nn.Module):
    """Skip the gradient reduction of this backward (an accumulation micro-step): FSDP2's
    set_requires_gradient_sync, or DDP's no_sync."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):

        @contextlib.contextmanager
        def paused():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return paused()
    ddp_no_sync = getattr(model, "no_sync", None)  # DDP's (through torch.compile's wrapper too)
    return ddp_no_sync() if ddp_no_sync is not None else contextlib.nullcontext()
