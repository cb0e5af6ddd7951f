"""The evaluator: HellaSwag-format scoring against a hand computation, and its input errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import REPO

from lmyard.config import EvalGates, TokenizerConfig
from lmyard.data.tokenizer import get_tokenizer
from lmyard.errors import UserError
from lmyard.evaluate import evals
from lmyard.evaluate.gates import gate_results
from lmyard.models.gpt2.model import GPT, GPTConfig

FIXTURE = REPO / "tests" / "fixtures" / "hellaswag_tiny.jsonl"
V = 320  # the byte tokenizer's 257 tokens, rounded up to 64


def unigram_gpt(logit_of: dict[int, float]) -> GPT:
    """A real GPT whose every position predicts the same distribution: softmax of `logit_of` (others 0).

    The blocks' output projections are zero, so the residual stream is the embedding;
    ln_f has zero gain and bias e_0, so the final features are e_0 everywhere and the
    (tied) logits are wte[:, 0].
    """
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=V))
    with torch.no_grad():
        for block in model.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        model.wte.weight[:, 0] = 0.0
        for token, logit in logit_of.items():
            model.wte.weight[token, 0] = logit
    return model.eval()


def test_hellaswag_scoring_reproduces_a_hand_computation():
    enc = get_tokenizer(TokenizerConfig(name="bytes"))
    a, space = enc.encode_ordinary("a")[0], enc.encode_ordinary(" ")[0]
    assert space != a
    model = unigram_gpt({a: math.log(64)})
    # p(a) = 64 / (319 + 64); any other token: 1 / 383
    other, a_loss = math.log(383), math.log(383 / 64)
    # each ending is scored as " " + ending: the space costs `other`, then its letters
    expected_sums = [
        [other + 4 * a_loss, 2 * other + a_loss, 2 * other, other + 12 * a_loss],  # sums 13.10 13.69 11.90 27.42
        [other + a_loss, 3 * other, 4 * other, 2 * other + a_loss],  # sums  7.74 17.84 23.79 13.69
    ]
    lengths = [[5, 3, 2, 13], [2, 3, 4, 3]]
    examples = evals.read_hellaswag(str(FIXTURE))
    result = evals.hellaswag(model, enc, examples)

    for row, sums, lens in zip(result.rows, expected_sums, lengths):
        assert row.losses == pytest.approx(sums, abs=1e-3)
        assert row.mean_losses == pytest.approx([s / n for s, n in zip(sums, lens)], abs=1e-3)
    # example 0 (label 3): the shortest ending has the lowest sum (2), the all-"a" one the lowest mean (3)
    # example 1 (label 0): " a" is lowest by both
    assert [(r.pred, r.pred_norm) for r in result.rows] == [(2, 3), (0, 0)]
    assert result.acc == 0.5 and result.acc_norm == 1.0 and result.n == 2


def test_long_contexts_lose_their_start_and_keep_the_ending():
    enc = get_tokenizer(TokenizerConfig(name="bytes"))
    tokens, mask = evals.render_example(enc, {"ctx": "x" * 100, "endings": ["yes", "no"], "label": 0}, block_size=16)
    assert tokens.shape == (2, 16)
    assert enc.decode(tokens[0].tolist()) == "x" * 12 + " yes"
    assert mask[0].tolist() == [0] * 12 + [1] * 4
    assert mask[1].tolist() == [0] * 13 + [1] * 3  # " no" is shorter: more context, no padding needed


def test_hellaswag_limit_and_bad_examples(tmp_path):
    assert len(evals.read_hellaswag(str(FIXTURE), limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 5}\n')
    with pytest.raises(UserError, match="label 5 for 2 endings"):
        evals.read_hellaswag(str(bad))
    with pytest.raises(UserError, match="does not exist"):
        evals.read_hellaswag(str(tmp_path / "missing.jsonl"))


def test_gates_pass_only_when_every_configured_gate_holds():
    result = {"loss/eval": 2.0, "task/hellaswag_acc_norm": 0.3}
    assert gate_results(EvalGates(), result) == {}
    ok = gate_results(EvalGates(val_loss_max=2.5, hellaswag_acc_norm_min=0.25), result)
    assert all(g["passed"] for g in ok.values())
    failed = gate_results(EvalGates(val_loss_max=1.5), result)
    assert failed["val_loss_max"] == {"value": 2.0, "limit": 1.5, "passed": False}
    unmeasured = gate_results(EvalGates(hellaswag_acc_norm_min=0.1), {"loss/eval": 2.0})
    assert not unmeasured["hellaswag_acc_norm_min"]["passed"]


def test_gates_on_any_logged_metric_take_the_final_evaluation_over_the_runs_latest_value():
    gates = EvalGates(
        val_loss_max=2.5,
        metrics=[
            {"metric": "loss/val", "max": 3.0},
            {"metric": "task/hellaswag_acc", "min": 0.3},
            {"metric": "task/arc/acc", "min": 0.5},
        ],
    )
    result = {"loss/eval": 2.0, "task/hellaswag_acc": 0.25, "task/hellaswag_acc_norm": 0.3, "task/arc/acc": 0.6}
    out = gate_results(gates, result, logged={"loss/val": 2.9, "loss/eval": 9.0, "task/hellaswag_acc": 0.9})
    assert list(out) == ["val_loss_max", "loss/val max", "task/hellaswag_acc min", "task/arc/acc min"]
    assert out["val_loss_max"] == {"value": 2.0, "limit": 2.5, "passed": True}  # the final evaluation's, not 9.0
    assert out["loss/val max"] == {"value": 2.9, "limit": 3.0, "passed": True}  # logged by the trainer only
    assert out["task/hellaswag_acc min"] == {"value": 0.25, "limit": 0.3, "passed": False}
    assert out["task/arc/acc min"]["passed"]
    assert not gate_results(EvalGates(metrics=[{"metric": "nowhere", "max": 1.0}]), result)["nowhere max"]["passed"]
