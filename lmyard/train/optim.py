"""The optimizer step: AdamW, with the gradient clip's scale applied inside it.

`clipped_update(params, optimizer, max_norm)` is the end of every training step: the global
gradient norm (over the ranks' shards under FSDP2), the clip's scale `min(1, max_norm / (norm +
1e-6))` as torch's `clip_grad_norm_` computes it, then `AdamW.step(grad_scale=scale)`.

`AdamW` is torch's (its hyper-parameters, state and state_dict: checkpoints of either load into
the other). On CUDA its step with a `grad_scale` is one Triton launch a parameter group (a table
of the tensors' addresses, each program a block of one tensor) that reads the weight, gradient
and both moments once and writes the weight and moments once, the gradient scaled as it is
read. At GPT-2 124M (148 tensors) one launch a tensor made the step 7.4 ms, the GPU waiting on
the host's launches, against 2.6 ms in one launch a group (bench_optimizer.py, H100). Clipping
and then stepping with torch's fused AdamW reads the gradients three times and writes them once
more: at the Llama-3 8B shape on 4 GPUs that is 16 of the 80 GB the optimizer moves per GPU,
1.3x its time (tests/benchmarks/bench_optimizer.py). Elsewhere (CPU, no Triton, or options the
kernel does not take: amsgrad, maximize, capturable, differentiable) the step scales the
gradients in place and runs torch's own.
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; CPU installs run torch's step
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 2048  # elements a program: a sweep on H100 (bench_optimizer.py --sweep)
NUM_WARPS = 8
_ROW = 6  # the kernel's table: weight, gradient, exp_avg, exp_avg_sq and step addresses, then the element count

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
    ):
        """One AdamW update of `BLOCK` elements of one of a group's tensors, the gradient times *scale_ptr.
        `table_ptr` holds a row a tensor (ROW entries: the addresses of weight, gradient, both moments and
        the step, then the element count); this program's tensor and block come from the two block maps. The step
        already counts this update. 1 - beta and the bias corrections 1 - beta^step are made in float64, as
        torch's foreach AdamW makes them on the host: from a float32 beta2 of 0.999, 1 - beta2 is 1.3e-5 off."""
        pid = tl.program_id(0)
        row = table_ptr + tl.load(tensor_of_block_ptr + pid).to(tl.int64) * ROW
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
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
        g = tl.load(g_ptr + offs, mask=mask, other=0.0) * tl.load(scale_ptr)
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what the kernel updates in place); a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose `step(grad_scale=s)` uses gradient x s (the clip's scale), fused on CUDA."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._betas: dict[tuple, torch.Tensor] = {}  # (device, beta1, beta2) -> the kernel's float64 betas

    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        if grad_scale is None:
            return super().step(closure)
        if closure is not None:
            raise ValueError("AdamW.step takes a closure or a grad_scale, not both")
        with torch.no_grad():
            rest = []
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if self._fusable(group, params):
                    self._fused_step(group, params, grad_scale)
                else:
                    rest.append(group)
            if _scale_grads([p for group in rest for p in group["params"]], grad_scale):
                # torch's step over the other groups only, their gradients scaled in place
                kept, self.param_groups = self.param_groups, rest
                try:
                    super().step()
                finally:
                    self.param_groups = kept
        return None

    def _fusable(self, group: dict, params: list[torch.Tensor]) -> bool:
        """Whether the kernel can step `params` (the group's with gradients)."""
        return (
            triton is not None
            and bool(params)
            and all(_kernel_takes(p) and _kernel_takes(p.grad) for p in params)
            and not any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable"))
            and not torch.is_complex(params[0])
        )

    def _fused_step(self, group: dict, params: list, grad_scale: torch.Tensor) -> None:
        for p in params:
            state = self.state[p]
            if not state:  # as torch's fused AdamW starts it: a float32 step on the device, zero moments
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:  # torch's unfused AdamW keeps it on the CPU (its state loaded)
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1.0)
        device = params[0].device
        key = (device, *map(float, group["betas"]))
        if key not in self._betas:  # made once: a copy from the host each step would wait for the GPU
            self._betas[key] = torch.tensor(key[1:], dtype=torch.float64, device=device)
        table, blocks = _launch_tables(params, [self.state[p] for p in params], device)
        if blocks[0].numel() == 0:  # every tensor of the group empty (FSDP2 shards of a small model)
            return
        _adamw_kernel[(blocks[0].numel(),)](
            table, *blocks, grad_scale.to(device=device, dtype=torch.float32), self._betas[key],
            float(group["lr"]), group["eps"], group["weight_decay"], BLOCK=BLOCK, ROW=_ROW, num_warps=NUM_WARPS,
        )  # fmt: skip


_block_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _launch_tables(params: list, states: list[dict], device: torch.device):
    """The kernel's inputs for one launch over `params`: the table of addresses (a row a tensor, made each
    step: gradients are new tensors each step) and the block maps (each program's tensor and block in it,
    made once per set of sizes). One launch a group, not one a tensor: a GPT-2 124M step is 148 tensors."""
    rows = []
    for p, state in zip(params, states):
        w = _local(p)
        tensors = (w, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
        rows.append([t.data_ptr() for t in tensors] + [w.numel()])
    sizes = tuple(row[-1] for row in rows)
    key = (device, BLOCK, sizes)
    if key not in _block_maps:
        per_tensor = torch.tensor([-(-n // BLOCK) for n in sizes], dtype=torch.int64)
        tensor_of_block = torch.repeat_interleave(torch.arange(len(sizes)), per_tensor)
        first = torch.repeat_interleave(torch.cumsum(per_tensor, 0) - per_tensor, per_tensor)
        block_in_tensor = torch.arange(tensor_of_block.numel()) - first
        _block_maps[key] = (tensor_of_block.to(device, torch.int32), block_in_tensor.to(device, torch.int32))
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copy does not wait for the GPU, and the buffer lives until it is done
        table = table.pin_memory().to(device, non_blocking=True)
    return table, _block_maps[key]


def _kernel_takes(t: torch.Tensor | None) -> bool:
    """Whether the kernel reads and writes `t` as it is: float32, contiguous (a DTensor's shard), on CUDA."""
    return t is not None and t.is_cuda and t.dtype == torch.float32 and _local(t).is_contiguous()


def _scale_grads(params: list[torch.Tensor], scale: torch.Tensor) -> bool:
    """Multiply the gradients of `params` by `scale` in place; False when none has one."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return bool(grads)


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients, as a plain tensor: a DTensor's (FSDP2) is reduced over the ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm


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
    if isinstance(optimizer, AdamW):
        optimizer.step(grad_scale=scale)
    else:
        _scale_grads(params, scale)
        optimizer.step()
    return norm
