"""train.optimizer=muon: the parameter split, Muon's step against its formula, one state dict, FSDP refused; and
train.schedule=wsd."""

from __future__ import annotations

import copy

import pytest
import torch

from lmyard.config import TrainConfig
from lmyard.errors import UserError
from lmyard.models.gpt2.model import GPT, GPTConfig
from lmyard.models.llama.model import Llama, LlamaConfig
from lmyard.recipes import load_recipe
from lmyard.train import build
from lmyard.train.optim import clipped_update
from lmyard.train.trainer import StepParts, lr_at, train_step


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64))


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt2", "llama"])
def test_the_split_puts_every_parameter_in_exactly_one_group_and_only_block_matrices_in_muons(make):
    model = make()
    opt = build.optimizer(model, TrainConfig(optimizer="muon"), fused=False)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters()) and len(seen) == len(set(seen))
    in_blocks = {id(p) for p in model.layers.parameters()}
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    assert muon_ids == {id(p) for p in model.layers.parameters() if p.dim() == 2}
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert tables and not muon_ids & {id(w) for w in tables}  # embeddings (and GPT-2's tied head) go to AdamW
    assert all(id(p) not in in_blocks or p.dim() < 2 for g in opt.adamw.param_groups for p in g["params"])


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration, written out: X / |X|, then X <- aX + (bA + cA^2)X with A = XX^T,
    in bf16, on the wide orientation (each product as torch's addmm rounds it)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def test_a_muon_step_matches_the_formula_on_a_tiny_model():
    model, ref = _gpt(), _gpt()
    t = TrainConfig(optimizer="muon", muon_lr=0.05, muon_momentum=0.9, muon_weight_decay=0.01, grad_clip=0.5)
    opt = build.optimizer(model, t, fused=False)
    x = torch.randint(0, 64, (2, 16))
    bufs = {}
    for step in range(2):
        lr = lr_at(step, t)
        plain = torch.autocast("cpu", enabled=False)
        train_step(StepParts(model, list(model.parameters()), opt, plain, False, t.grad_clip), lambda: (x, x), 1, lr)
        ref.zero_grad()
        ref(x, x).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
        scale = torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s factor
        muon_lr = lr * t.muon_lr / t.lr
        with torch.no_grad():
            for name, p in ref.layers.named_parameters():
                if p.dim() != 2:
                    continue
                g = p.grad * scale
                buf = bufs[name] = bufs.get(name, torch.zeros_like(g)).lerp(g, 1 - t.muon_momentum)  # momentum
                update = g.lerp(buf, t.muon_momentum)  # Nesterov
                p.mul_(1 - muon_lr * t.muon_weight_decay)
                p.add_(_newton_schulz(update).float(), alpha=-muon_lr * max(1.0, p.size(0) / p.size(1)) ** 0.5)
            for name, p in model.named_parameters():
                mine = dict(ref.named_parameters())[name]
                if p.dim() == 2 and name.startswith(("h.", "layers.")):
                    torch.testing.assert_close(p, mine, rtol=0, atol=1e-6)
                else:  # AdamW's part is not under test: the reference takes its weights
                    mine.copy_(p)


def test_the_state_dict_holds_both_optimizers_state_and_loads_into_a_fresh_one_step_for_step():
    t = TrainConfig(optimizer="muon")
    x = torch.randint(0, 64, (2, 16))

    def one_step(model, opt):
        model(x, x).backward()
        clipped_update(list(model.parameters()), opt, 1.0)
        opt.zero_grad(set_to_none=True)

    a = _gpt()
    opt_a = build.optimizer(a, t, fused=False)
    one_step(a, opt_a)
    saved = copy.deepcopy(opt_a.state_dict())  # as a checkpoint holds it: not a's live tensors
    kinds = {frozenset(s) for s in saved["state"].values()}
    assert {"momentum_buffer"} in kinds and any("exp_avg_sq" in k for k in kinds)
    b = _gpt(seed=1)
    b.load_state_dict(a.state_dict())
    opt_b = build.optimizer(b, t, fused=False)
    opt_b.load_state_dict(saved)
    assert opt_b.muon.state is opt_b.state and opt_b.adamw.param_groups[0] is opt_b.param_groups[0]
    one_step(a, opt_a)
    one_step(b, opt_b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_muon_under_fsdp_is_refused_in_one_line_before_training(tmp_path):
    with pytest.raises(UserError) as info:
        load_recipe("smoke", ["train.optimizer=muon", "train.parallel=fsdp"])
    said = str(info.value)
    assert "train.optimizer=muon needs train.parallel=ddp" in said and "\n" not in said.strip()


def test_adamw_is_still_torch_adamw_over_the_models_own_groups():
    model = _gpt()
    opt = build.optimizer(model, TrainConfig(), fused=False)
    assert type(opt).__name__ == "AdamW" and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in model.param_groups(0.1)]


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    t = TrainConfig(schedule="wsd", lr=1.0, warmup_steps=10, max_steps=110, decay_fraction=0.2, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert all(lr_at(s, t) == pytest.approx(1.0) for s in range(10, 91))  # stable: 80 of the 100 steps after warmup
    assert lr_at(100, t) == pytest.approx(0.55)  # halfway through the decay
    assert lr_at(110, t) == pytest.approx(0.1) and lr_at(500, t) == pytest.approx(0.1)
    assert all(lr_at(s, t) > lr_at(s + 1, t) for s in range(90, 110))
    longer = t.model_copy(update={"max_steps": 210})  # an extended lineage: the same lr until its own decay
    assert all(lr_at(s, longer) == pytest.approx(lr_at(s, t)) for s in range(91))


def test_a_resume_under_another_schedule_says_so_in_one_line():
    saved = {"train": TrainConfig().model_dump()}
    assert build.schedule_change(saved, TrainConfig(), 8) is None
    said = build.schedule_change(saved, TrainConfig(schedule="wsd", max_steps=900), 8)
    assert said is not None and "\n" not in said
    assert "schedule cosine -> wsd" in said and "max_steps 800 -> 900" in said and "step 8" in said
