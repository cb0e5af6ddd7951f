"""The optimizer step: AdamW, with the gradient clip's scale applied inside it.

`clipped_update(params, optimizer, max_norm)` is the end of every training step: the global
gradient norm (over the ranks' shards under FSDP2), the clip's scale `min(1, max_norm / (norm +
1e-6))` as torch's `clip_grad_norm_` computes it, then `AdamW.step(grad_scale=scale)`.

Design notes: docs/training.md, `lmyard/train/optim.py`.
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs run torch's step
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 1024  # elements a program, and warps: a sweep on H200 (bench_optimizer.py --sweep: 15.6 ms against 17.3 for
NUM_WARPS = 4  # 2048 and 8, the H100's choice, where block sizes from 1,024 to 8,192 had measured within 2%)
NORM_BLOCK = 4096  # the gradient norm's elements a program, and its warps: a sweep on H200 (1.09 ms where
NORM_WARPS = 8  # torch's foreach norm took 2.01, the bf16 gradients of one rank's share of 8B on 4 GPUs)
_ROW = 7  # the kernel's table: weight, gradient, exp_avg, exp_avg_sq and step addresses, the element count, the master's address
MASTER_ATTR = "lmyard_master"  # a bf16 parameter's float32 master weights until its state is made (keep_master)

if triton is not None:

    @triton.jit
    def _adamw_kernel(
        table_ptr,
        tensor_of_block_ptr,
        block_in_tensor_ptr,
        scale_ptr,
        betas_ptr,
        lr,
        eps,
        weight_decay,
        BLOCK: tl.constexpr,
        ROW: tl.constexpr,
        MASTER: tl.constexpr,
    ):
        """One AdamW update of `BLOCK` elements of one tensor, the gradient times *scale_ptr; a `table_ptr` row a
        tensor (addresses of weight, gradient, moments, step; element count; fp32 master), tensor and block from the
        block maps. MASTER: bf16 weight and gradient, updated on the master, written back rounded (rtne); the step
        counts this update; 1 - beta and 1 - beta^step in float64, as torch's foreach AdamW (docs/training.md)."""
        pid = tl.program_id(0)
        row = table_ptr + tl.load(tensor_of_block_ptr + pid).to(tl.int64) * ROW
        if MASTER:
            low_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16))
            g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
        else:
            g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        p_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32))).to(tl.float64)
        n = tl.load(row + 5)
        offs = tl.load(block_in_tensor_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        beta1_64, beta2_64 = tl.load(betas_ptr), tl.load(betas_ptr + 1)
        bias1 = (1.0 - tl.exp(step * tl.log(beta1_64))).to(tl.float32)
        bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2_64))).to(tl.float32)
        beta1, beta2 = beta1_64.to(tl.float32), beta2_64.to(tl.float32)
        rest1, rest2 = (1.0 - beta1_64).to(tl.float32), (1.0 - beta2_64).to(tl.float32)  # 1 - 0.999 in float32
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * (1.0 - lr * weight_decay)
        m = beta1 * m + rest1 * g
        v = beta2 * v + rest2 * g * g
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if MASTER:
            tl.store(low_ptr + offs, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _sum_squares_kernel(
        table_ptr, tensor_of_block_ptr, block_in_tensor_ptr, out_ptr, BLOCK: tl.constexpr, LOW: tl.constexpr
    ):
        """The float32 sum of squares of `BLOCK` elements of one gradient into out_ptr[program]. `table_ptr`
        holds a row a tensor: its address and element count; LOW: the gradients are bf16, else float32."""
        pid = tl.program_id(0)
        row = table_ptr + tl.load(tensor_of_block_ptr + pid).to(tl.int64) * 2
        if LOW:
            g_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16))
        else:
            g_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        offs = tl.load(block_in_tensor_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + offs, mask=offs < tl.load(row + 1), other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(g * g))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what the kernel updates in place); a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def keep_master(param: torch.Tensor, master: torch.Tensor) -> None:
    """Give a bf16 parameter the float32 weights AdamW starts its master copy from (the weights before they
    were rounded to bf16: lmyard.train.distributed.parallel casts FSDP2's shards); without one the master starts from the
    bf16 values."""
    setattr(param, MASTER_ATTR, master)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose `step(grad_scale=s)` uses gradient x s (the clip's scale), fused on CUDA.

    A bf16 parameter (train.fsdp_param_dtype=bfloat16) gets float32 master weights in its state (`master`),
    and float32 moments: the kernel updates the master from the bf16 gradient and writes the parameter as the
    master rounded to bf16; where the kernel cannot run, torch's step updates the masters."""

    takes_grad_scale = True  # clipped_update hands the clip's scale to step()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._betas: dict[tuple, torch.Tensor] = {}  # (device, beta1, beta2) -> the kernel's float64 betas
        self._ones: dict[torch.device, torch.Tensor] = {}

    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        if grad_scale is None and not self._has_masters():
            return super().step(closure)
        if closure is not None:
            raise ValueError("AdamW.step takes a closure or a grad_scale, not both")
        with torch.no_grad():
            rest = []
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if self._fusable(group, params):
                    self._fused_step(group, params, grad_scale)
                    continue
                low = [p for p in params if p.dtype == torch.bfloat16]
                if low:
                    self._master_step(group, low, grad_scale)
                rest.append({**group, "params": [p for p in group["params"] if p.dtype != torch.bfloat16]})
            params = [p for group in rest for p in group["params"]]
            if _scale_grads(params, grad_scale) if grad_scale is not None else any(p.grad is not None for p in params):
                # torch's step over the other groups only, their gradients scaled in place
                kept, self.param_groups = self.param_groups, rest
                try:
                    super().step()
                finally:
                    self.param_groups = kept
        return None

    def _has_masters(self) -> bool:
        return any(p.dtype == torch.bfloat16 for group in self.param_groups for p in group["params"])

    def _fusable(self, group: dict, params: list[torch.Tensor]) -> bool:
        """Whether the kernel can step `params` (the group's with gradients)."""
        return (
            triton is not None
            and bool(params)
            and all((dtype := _kernel_dtype(p)) is not None and dtype == _kernel_dtype(p.grad) for p in params)
            and not any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable"))
        )

    def _fused_step(self, group: dict, params: list, grad_scale: torch.Tensor | None) -> None:
        for p in params:
            self._init_state(p)
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1.0)
        device = params[0].device
        key = (device, *map(float, group["betas"]))
        if key not in self._betas:  # made once: a copy from the host each step would wait for the GPU
            self._betas[key] = torch.tensor(key[1:], dtype=torch.float64, device=device)
        if grad_scale is None:  # a step without a clip (torch.distributed.checkpoint's state initialisation)
            grad_scale = self._ones.setdefault(device, torch.ones((), device=device))
        for master in (False, True):  # one launch per kind: float32 weights, bf16 weights with float32 masters
            kind = [p for p in params if (p.dtype == torch.bfloat16) == master]
            if not kind:
                continue
            table, blocks = _launch_tables(kind, [self.state[p] for p in kind], device)
            if blocks[0].numel() == 0:  # every tensor of the group empty (FSDP2 shards of a small model)
                continue
            _adamw_kernel[(blocks[0].numel(),)](
                table, *blocks, grad_scale.to(device=device, dtype=torch.float32), self._betas[key],
                float(group["lr"]), group["eps"], group["weight_decay"], BLOCK=BLOCK, ROW=_ROW, MASTER=master,
                num_warps=NUM_WARPS,
            )  # fmt: skip

    def _master_step(self, group: dict, params: list, grad_scale: torch.Tensor | None) -> None:
        """torch's own step on the float32 masters of bf16 parameters, where the kernel cannot run (the CPU):
        the gradients cast up and scaled, then each parameter set to its master rounded to bf16."""
        for p in params:
            self._init_state(p)
        masters = [self.state[p]["master"] for p in params]
        for p, master in zip(params, masters):
            master.grad = p.grad.to(torch.float32)
            self.state[master] = self.state[p]  # torch's step finds a parameter's state by the parameter
        if grad_scale is not None:
            _scale_grads(masters, grad_scale)
        kept, self.param_groups = self.param_groups, [{**group, "params": masters}]
        try:
            super().step()
        finally:
            self.param_groups = kept
            for p, master in zip(params, masters):
                del self.state[master]
                master.grad = None
                p.copy_(master)

    def _init_state(self, p: torch.Tensor) -> None:
        """As torch's fused AdamW starts it: a float32 step on the device, zero moments; a bf16 parameter's
        moments in float32 beside its float32 master weights."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            like = p
            if p.dtype == torch.bfloat16:
                kept = p.__dict__.pop(MASTER_ATTR, None)
                like = state["master"] = kept if kept is not None else p.detach().to(torch.float32)
            state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # torch's unfused AdamW keeps it on the CPU (its state loaded)
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        if p.dtype == torch.bfloat16 and "master" not in state:  # state loaded from float32 weights' optimizer
            state["master"] = p.detach().to(torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts each floating state tensor to its parameter's dtype: a bf16 parameter's master
        weights and moments are put back in float32, from the values given."""
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            if p.dtype != torch.bfloat16 or i not in state_dict["state"]:
                continue
            for k, v in state_dict["state"][i].items():
                if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32)


_block_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _launch_tables(params: list, states: list[dict], device: torch.device):
    """The kernel's inputs for one launch over `params`: the table of addresses (a row a tensor, made each
    step: gradients are new tensors each step) and the block maps (each program's tensor and block in it,
    made once per set of sizes). One launch a group, not one a tensor: a GPT-2 124M step is 148 tensors."""
    rows = []
    for p, state in zip(params, states):
        w = _local(p)
        tensors = (w, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
        master = _local(state["master"]) if p.dtype == torch.bfloat16 else w
        rows.append([t.data_ptr() for t in tensors] + [w.numel(), master.data_ptr()])
    return _to_device(rows, device), _block_map(tuple(row[5] for row in rows), BLOCK, device)


def _to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """A launch's table of addresses on `device`: made each step (gradients are new tensors each step)."""
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copy does not wait for the GPU, and the buffer lives until it is done
        table = table.pin_memory().to(device, non_blocking=True)
    return table


def _block_map(sizes: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each program's tensor and its block in that tensor, for tensors of `sizes` in blocks of `block` elements
    (made once per set of sizes)."""
    key = (device, block, sizes)
    if key not in _block_maps:
        per_tensor = torch.tensor([-(-n // block) for n in sizes], dtype=torch.int64)
        tensor_of_block = torch.repeat_interleave(torch.arange(len(sizes)), per_tensor)
        first = torch.repeat_interleave(torch.cumsum(per_tensor, 0) - per_tensor, per_tensor)
        block_in_tensor = torch.arange(tensor_of_block.numel()) - first
        _block_maps[key] = (tensor_of_block.to(device, torch.int32), block_in_tensor.to(device, torch.int32))
    return _block_maps[key]


def _kernel_dtype(t: torch.Tensor | None) -> torch.dtype | None:
    """The dtype the kernel reads and writes `t` in (float32, or bf16 beside a float32 master), as it is:
    contiguous (a DTensor's shard), on CUDA; None where it cannot."""
    ok = t is not None and t.is_cuda and t.dtype in (torch.float32, torch.bfloat16) and _local(t).is_contiguous()
    return t.dtype if ok and t is not None else None


def _scale_grads(params: list[torch.Tensor], scale: torch.Tensor) -> bool:
    """Multiply the gradients of `params` by `scale` in place; False when none has one."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return bool(grads)


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients, as a plain tensor: a DTensor's (FSDP2) is reduced over the ranks.
    Summed in float32, bf16 gradients too (torch's get_total_norm keeps their dtype). On CUDA one launch a
    gradient dtype sums the squares of every shard (`_sum_squares_kernel`); elsewhere torch's foreach norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if _summable(grads):
        return _sum_squares(grads).sqrt()
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm


def _summable(grads: list[torch.Tensor]) -> bool:
    """Whether the kernel can sum the squares of `grads`: each one the kernel reads, and either all plain
    tensors or all shards (FSDP2's) on one mesh, so that their sums add up over its ranks."""
    if triton is None or any(_kernel_dtype(g) is None for g in grads):
        return False
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    if meshes == {None}:
        return True
    return len(meshes) == 1 and all(pl.is_shard() for g in grads for pl in getattr(g, "placements", ()))


def _sum_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `grads` (all ranks' shards), float32, on their device."""
    device = grads[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for low in (False, True):
        kind = [_local(g) for g in grads if (g.dtype == torch.bfloat16) == low]
        tensor_of_block, block_in_tensor = _block_map(tuple(g.numel() for g in kind), NORM_BLOCK, device)
        if tensor_of_block.numel() == 0:  # none of this dtype, or every shard empty
            continue
        partial = torch.empty(tensor_of_block.numel(), dtype=torch.float32, device=device)
        table = _to_device([[g.data_ptr(), g.numel()] for g in kind], device)
        _sum_squares_kernel[(partial.numel(),)](
            table, tensor_of_block, block_in_tensor, partial, BLOCK=NORM_BLOCK, LOW=low, num_warps=NORM_WARPS
        )
        total = total + partial.sum()
    mesh = getattr(grads[0], "device_mesh", None)
    if mesh is None:
        return total
    from torch.distributed.tensor import DTensor, Partial

    return DTensor.from_local(total, mesh, [Partial()] * mesh.ndim).full_tensor()


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ factor: min(1, max_norm / (norm + 1e-6)), on the device, without a sync."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clipped_update(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float, before_update=None):
    """The gradients' norm, then the optimizer's step on gradients clipped to `max_norm` (inf: no clip);
    returns the norm before clipping. `before_update` runs between them (a checkpoint copy in flight)."""
    norm = grad_norm(params)
    scale = clip_scale(norm, max_norm)
    if before_update is not None:
        before_update()
    if getattr(optimizer, "takes_grad_scale", False):  # AdamW, and Muon beside it (lmyard.train.muon)
        optimizer.step(grad_scale=scale)  # type: ignore[call-overload]
    else:
        _scale_grads(params, scale)
        optimizer.step()
    return norm
