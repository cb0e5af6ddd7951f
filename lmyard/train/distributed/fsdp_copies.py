"""FSDP2's layout copies on the copy engines, off the compute stream (train.fsdp_copies).

Design notes: docs/models.md, `lmyard/train/distributed/fsdp_copies.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
import torch.nn as nn

_ORIGINAL: dict[str, Any] = {}
_SPLIT_DONE: dict[int, tuple[Any, torch.cuda.Event]] = {}  # id(fsdp_params) -> (its all-gather result, split's event)
_HELD_GRADS: dict[int, tuple[list[torch.Tensor], torch.cuda.Event]] = {}  # id(comm_ctx) -> (grads, their cat's event)
_REDUCING = contextvars.ContextVar("_REDUCING", default=None)  # the FSDPParamGroup in post_backward
_GATHERING = contextvars.ContextVar("_GATHERING", default=False)  # a flagged FSDPParamGroup in unshard
_FLAG = "_lmyard_copies_off_compute"


def _internals():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    return _fsdp_param_group, _fsdp_collectives, _fsdp_param


def missing() -> str | None:
    """What this torch's FSDP2 lacks for `move_off_compute`, or None."""
    try:
        group, collectives, param = _internals()
    except ImportError as e:
        return f"FSDP2's internals ({e})"
    needs = [
        (group, "foreach_all_gather"),
        (group, "foreach_all_gather_copy_out"),
        (collectives, "_get_param_all_gather_inputs"),
        (collectives, "_get_all_gather_input_metadatas"),
        (collectives, "foreach_reduce_scatter_copy_in"),
        (group.FSDPParamGroup, "unshard"),
        (group.FSDPParamGroup, "post_backward"),
        (group.FSDPParamGroup, "finalize_backward"),
        (param.FSDPParam, "init_all_gather_outputs"),
        (param.FSDPParam, "alloc_all_gather_outputs"),
    ]
    absent = [name for owner, name in needs if not hasattr(owner, name)]
    return f"FSDP2's {', '.join(absent)} (torch {torch.__version__})" if absent else None


def move_off_compute(model: nn.Module, units: list[nn.Module]) -> None:
    """Make the copy-in, the split and the cat of every FSDP2 unit of `model` (fully_shard applied) memcpys on
    FSDP2's side streams, and prefetch `units` (the blocks, in forward order) one ahead in forward; the root
    prefetches the first."""
    from torch.distributed.fsdp import FSDPModule

    _install()
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None:
            setattr(group, _FLAG, True)
    chain: list[Any] = [model, *units]  # FSDPModules, as fully_shard made them
    for unit, after in zip(chain, chain[1:]):
        unit.set_modules_to_forward_prefetch([after])


def _install() -> None:
    if _ORIGINAL:
        return
    group, collectives, _ = _internals()
    cls = group.FSDPParamGroup
    _ORIGINAL.update(
        unshard=cls.unshard,
        post_backward=cls.post_backward,
        finalize_backward=cls.finalize_backward,
        copy_out=group.foreach_all_gather_copy_out,
        all_gather=group.foreach_all_gather,
        copy_in=collectives.foreach_reduce_scatter_copy_in,
    )
    cls.unshard = _unshard
    cls.post_backward = _post_backward
    cls.finalize_backward = _finalize_backward
    group.foreach_all_gather_copy_out = _copy_out
    group.foreach_all_gather = _foreach_all_gather
    collectives.foreach_reduce_scatter_copy_in = _copy_in


def _unshard(self, async_op: bool = False):
    """FSDPParamGroup.unshard: a flagged group's all-gather by _foreach_all_gather, and its split queued
    right behind it."""
    pending = self._all_gather_result
    token = _GATHERING.set(getattr(self, _FLAG, False))
    try:
        _ORIGINAL["unshard"](self, async_op)
    finally:
        _GATHERING.reset(token)
    result = self._all_gather_result
    if result is None or result is pending or not getattr(self, _FLAG, False):
        return
    if result.all_gather_event is None or not result.param_all_gather_input_numels:  # async op, or one rank
        return
    _split_on_all_gather_stream(self, result)


def _foreach_all_gather(fsdp_params, group, async_op, copy_in_stream, all_gather_stream, device, comm):
    """FSDP2's foreach_all_gather (torch 2.11-2.13), its copy-in (the shards into this rank's part of the
    buffer, a multi-tensor kernel on the copy-in stream) made one memcpy a parameter."""
    if not _GATHERING.get():
        return _ORIGINAL["all_gather"](fsdp_params, group, async_op, copy_in_stream, all_gather_stream, device, comm)
    _, collectives, _ = _internals()
    world, rank = group.size(), group.rank()
    with torch.cuda.stream(copy_in_stream):
        inputs = collectives._get_param_all_gather_inputs(fsdp_params)
        dtypes, numels, dtype = collectives._get_all_gather_input_metadatas(inputs)
        flat = [t.view(torch.uint8) if dtype == torch.uint8 else t for ts in inputs for t in ts]
        sizes = [t.numel() for t in flat]
        output = comm.allocate((sum(sizes) * world,), dtype=dtype, device=device)
        mine = output.narrow(0, sum(sizes) * rank, sum(sizes))
        with torch.no_grad():
            for into, shard in zip(torch.split(mine, sizes), flat):
                into.view(shard.shape).copy_(shard)
        del inputs, flat
    all_gather_stream.wait_stream(copy_in_stream)
    with torch.cuda.stream(all_gather_stream):
        work = comm(output_tensor=output, input_tensor=mine, group=group, async_op=async_op)
        return collectives.AllGatherResult(output, all_gather_stream.record_event(), work, dtypes, numels, sizes)


def _split_on_all_gather_stream(group, result) -> None:
    """Allocate the unit's parameters on the compute stream now, and split the gathered buffer into them with
    the copy engines on the all-gather stream once both the all-gather and that allocation are done."""
    world = group._all_gather_process_group.size()
    if not _splittable(result, group.fsdp_params):
        return
    shapes = zip(result.param_all_gather_input_numels, result.param_all_gather_input_dtypes, group.fsdp_params)
    for numels, dtypes, fsdp_param in shapes:
        fsdp_param.init_all_gather_outputs(numels, dtypes, world, group.device)
        fsdp_param.alloc_all_gather_outputs()
    allocated = torch.cuda.current_stream().record_event()
    stream = group.comm_ctx.get_all_gather_streams(False, group._training_state)[1]
    with torch.cuda.stream(stream):
        stream.wait_event(allocated)
        gathered = result.all_gather_output.view(world, -1)
        outputs = [out for fsdp_param in group.fsdp_params for out in fsdp_param.all_gather_outputs]
        _copy_rows(gathered, [out.view(world, -1) for out in outputs], into_flat=False)
        _SPLIT_DONE[id(group.fsdp_params)] = (result, stream.record_event())


def _splittable(result, fsdp_params) -> bool:
    """Whether every parameter's piece of each rank's gathered chunk is one contiguous run of the buffer's
    dtype (dim-0 shards, one dtype): then the split is a memcpy a parameter and rank."""
    dtype = result.all_gather_output.dtype
    return all(p.fsdp_placement.dim == 0 for p in fsdp_params) and all(
        d == dtype for dtypes in result.param_all_gather_input_dtypes for d in dtypes
    )


def _copy_rows(flat: torch.Tensor, pieces: list[torch.Tensor], into_flat: bool) -> None:
    """Copy each rank's row of every (world, n) piece to or from its columns of `flat` (world, sum of n), in
    order, one contiguous copy_ each (a memcpy, which the copy engines run), without bumping the pieces'
    version counters (autograd sees the parameters as unchanged, as under FSDP2's own copies)."""
    tracked = tuple(t for t in pieces if not t.is_inference())
    with torch.autograd._unsafe_preserve_version_counter(tracked) if tracked else contextlib.nullcontext():
        offset = 0
        for piece in pieces:
            columns = flat[:, offset : offset + piece.shape[1]]
            for rank in range(flat.shape[0]):
                (columns[rank] if into_flat else piece[rank]).copy_(piece[rank] if into_flat else columns[rank])
            offset += piece.shape[1]


def _copy_out(all_gather_result, fsdp_params, group) -> None:
    """FSDP2's copy-out, called where the compute stream needs the parameters: a wait where the split is
    already queued on the all-gather stream."""
    done = _SPLIT_DONE.pop(id(fsdp_params), None)
    if done is None or done[0] is not all_gather_result:
        _ORIGINAL["copy_out"](all_gather_result, fsdp_params, group)
        return
    torch.cuda.current_stream().wait_event(done[1])


def _post_backward(self, *unused: Any):
    """FSDPParamGroup.post_backward, telling _copy_in which group reduces (FSDP2 does not pass it)."""
    token = _REDUCING.set(self if getattr(self, _FLAG, False) else None)
    try:
        return _ORIGINAL["post_backward"](self, *unused)
    finally:
        _REDUCING.reset(token)


def _finalize_backward(self):
    """FSDPParamGroup.finalize_backward (the end of backward), letting go of the gradients held last."""
    _ORIGINAL["finalize_backward"](self)
    _release_grads(self.comm_ctx)


def _release_grads(comm_ctx) -> None:
    """Drop the gradients the last cat read, once the compute stream has waited for it (it is long done): the
    memory goes back to the compute stream's pool only then."""
    held = _HELD_GRADS.pop(id(comm_ctx), None)
    if held is not None:
        torch.cuda.current_stream().wait_event(held[1])


def _copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    """FSDP2's reduce-scatter copy-in: with the copy engines on the reduce-scatter stream after the gradients
    are complete, where each is a dim-0 multiple of the ranks in the buffer's dtype (else FSDP2's own cat).
    The gradients are held until the next copy-in (or the end of backward) waits for this one."""
    group = _REDUCING.get()
    dtype = reduce_scatter_input.dtype
    if group is None or any(
        g.dtype != dtype or g.shape[0] % world_size or not g.is_contiguous() for g in unsharded_grads
    ):
        _ORIGINAL["copy_in"](unsharded_grads, reduce_scatter_input, world_size)
        return
    _release_grads(group.comm_ctx)
    stream = group.comm_ctx.reduce_scatter_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pieces = [g.view(world_size, -1) for g in unsharded_grads]
        _copy_rows(reduce_scatter_input.view(world_size, -1), pieces, into_flat=True)
        _HELD_GRADS[id(group.comm_ctx)] = (list(unsharded_grads), stream.record_event())
