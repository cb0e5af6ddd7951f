"""lmyard.train.optim's Triton kernels in Triton's CPU interpreter against torch: AdamW, the gradient norm, bf16
weights stepping their float32 masters (the rest: tests/unit/train/test_optim.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.integration
def test_adamw_kernel_matches_torch_adamw_in_the_triton_interpreter():
    pytest.importorskip("triton")
    # The CUDA kernel's own code on CPU tensors in Triton's interpreter (set before triton is imported); the
    # device check that keeps CPU tensors off the kernel is lifted here. One launch a group over tensors of odd
    # sizes (the last block of each is masked) and an empty one.
    code = textwrap.dedent("""
        import torch
        import lmyard.train.optim as O
        O.BLOCK = 64
        O.AdamW._fusable = lambda self, group, params: True
        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(37, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 5))
        def groups(m):  # and an empty tensor, as an FSDP2 shard can be: no block of the launch is its
            m.empty = torch.nn.Parameter(torch.zeros(0))
            return [{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.1},
                    {"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
        a, b = model(), model()
        oa = O.AdamW(groups(a), lr=1e-2)  # torch's betas, 0.9 and 0.999: 1 - 0.999^step needs float64
        ob = torch.optim.AdamW(groups(b), lr=1e-2)
        for step in range(4):
            x = torch.randn(16, 37, generator=torch.Generator().manual_seed(step))
            for m in (a, b):
                m(x).pow(2).sum().backward()
                m.empty.grad = torch.zeros(0)
            O.clipped_update(list(a.parameters()), oa, 0.5)
            torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
            ob.step()
            oa.zero_grad(); ob.zero_grad()
        worst = max(((pa - pb).norm() / pb.norm()).item() for pa, pb in zip(a.parameters(), b.parameters()) if pb.numel())
        assert worst < 1e-6, worst
        assert float(oa.state[a[0].weight]["step"]) == 4.0
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.integration
def test_gradient_norm_kernel_sums_every_gradient_as_torchs_norm_does_in_the_triton_interpreter():
    pytest.importorskip("triton")
    # The CUDA kernel's own code on CPU tensors in Triton's interpreter: float32 and bf16 gradients of odd
    # sizes (the last block of each masked), an empty one; blocks of 64 so that each gradient spans several.
    code = textwrap.dedent("""
        import torch
        import lmyard.train.optim as O
        O.NORM_BLOCK = 64
        O._summable = lambda grads: True
        g = torch.Generator().manual_seed(0)
        params = []
        for n, dtype in ((300, torch.float32), (37, torch.float32), (0, torch.float32), (1000, torch.bfloat16), (65, torch.bfloat16)):
            p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            p.grad = (torch.randn(n, generator=g) * 3).to(dtype)
            params.append(p)
        ours = O.grad_norm(params)
        theirs = torch.nn.utils.get_total_norm([p.grad.float() for p in params])
        assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item(), (ours, theirs)
        params[0].grad[7] = float("inf")
        assert O.grad_norm(params).item() == float("inf")
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.integration
def test_bf16_weights_step_their_float32_masters_as_float32_weights_step_in_the_triton_interpreter():
    pytest.importorskip("triton")
    # bf16 weights with float32 masters (train.fsdp_param_dtype=bfloat16) beside float32 weights holding the
    # masters' values, given the same bf16 gradients: the masters move bit for bit as the float32 weights, and
    # survive a state_dict round trip in float32 (torch's load casts state to the parameter's dtype). The
    # interpreter rounds to bf16 towards zero where the GPU rounds to nearest even (tests/unit/train/test_fsdp.py checks
    # that on two GPUs), so the bf16 weights are checked to within one bf16 step here.
    code = textwrap.dedent("""
        import torch
        import lmyard.train.optim as O
        O.BLOCK = 64
        O._kernel_dtype = lambda t: t.dtype if t is not None and t.dtype in (torch.float32, torch.bfloat16) else None
        torch.manual_seed(0)
        shapes = [(37, 30), (300,), (0,), (5,)]
        init = [torch.randn(s) for s in shapes]
        def low_params():
            params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
            for p, t in zip(params, init):
                O.keep_master(p, t.clone())
            return params
        low, full = low_params(), [torch.nn.Parameter(t.clone()) for t in init]
        ol = O.AdamW([{"params": low, "weight_decay": 0.1}], lr=1e-2)
        of = O.AdamW([{"params": full, "weight_decay": 0.1}], lr=1e-2)
        def step(i, pairs):
            g = torch.Generator().manual_seed(i)
            for (opt_low, params_low), (opt_full, params_full) in pairs:
                grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
                for p, q, gr in zip(params_low, params_full, grads):
                    p.grad, q.grad = gr.clone(), gr.float()
                assert torch.equal(O.clipped_update(params_low, opt_low, 0.5), O.clipped_update(params_full, opt_full, 0.5))
        for i in range(3):
            step(i, [((ol, low), (of, full))])
        again = low_params()
        for p, q in zip(again, low):
            p.data.copy_(q.detach())
        ol2 = O.AdamW([{"params": again, "weight_decay": 0.1}], lr=1e-2)
        ol2.load_state_dict(ol.state_dict())
        step(3, [((ol2, again), (of, full))])
        for p, q in zip(again, full):
            st = ol2.state[p]
            assert p.dtype == torch.bfloat16 and all(st[k].dtype == torch.float32 for k in ("master", "exp_avg", "exp_avg_sq"))
            assert torch.equal(st["master"], q.detach()), (st["master"] - q).abs().max()
            assert torch.all((p.detach().float() - q.detach()).abs() <= q.detach().abs() * 2**-7)
        assert float(ol2.state[again[0]]["step"]) == 4.0
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
