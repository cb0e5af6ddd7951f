"""lm-evaluation-harness on the exported model: lm-eval's multiple-choice scoring of the local HellaSwag
examples gives lmyard's own HellaSwag acc and acc_norm on the same model."""

from __future__ import annotations

import json
import random

import pytest
from conftest import write_random_checkpoint

from lmyard.checkpoint.resume import load_step
from lmyard.config import TokenizerConfig, load_recipe
from lmyard.data.tokenizer import get_tokenizer
from lmyard.evaluate import evals, harness
from lmyard.store import open_store

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[harness]'")


def _examples(n: int, seed: int = 0) -> list[dict]:
    """HellaSwag-format examples of ASCII words: endings of different lengths, so acc and acc_norm differ."""
    rng = random.Random(seed)
    words = "the a cat sat on mat class for statement is an exception raised when error value module".split()
    out = []
    while len(out) < n:
        ex = {
            "ctx": " ".join(rng.choices(words, k=rng.randint(2, 6))).capitalize(),
            "endings": [" ".join(rng.choices(words, k=rng.randint(1, 5))) for _ in range(4)],
            "label": rng.randrange(4),
        }
        if len(ex["ctx"]) + max(len(e) for e in ex["endings"]) + 1 <= 64:  # fits the block: nothing truncated
            out.append(ex)
    return out


def test_lm_eval_hellaswag_gives_lmyards_acc_and_acc_norm(tmp_path):
    data = tmp_path / "hellaswag.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in _examples(24)))
    uri, _ = write_random_checkpoint(tmp_path / "store", seed=3)
    cfg = load_recipe("smoke", [f"eval.hellaswag={data}", "eval.harness_tasks=[hellaswag_local]"])
    ckpt = load_step(open_store(str(tmp_path / "store")), "r", 5, str(tmp_path / "cache"))

    ours = evals.hellaswag(
        evals.load_model(ckpt), get_tokenizer(TokenizerConfig(name="bytes")), evals.read_hellaswag(str(data))
    )
    theirs = harness.evaluate(ckpt, cfg)["metrics"]
    assert ours["acc"] != ours["acc_norm"]  # the two rules pick different endings here: both are tested
    assert theirs["hellaswag_local/acc"] == pytest.approx(ours["acc"], abs=1e-9)
    assert theirs["hellaswag_local/acc_norm"] == pytest.approx(ours["acc_norm"], abs=1e-9)


def test_harness_names_what_is_missing(tmp_path):
    from lmyard.errors import UserError

    uri, _ = write_random_checkpoint(tmp_path / "store")
    ckpt = load_step(open_store(str(tmp_path / "store")), "r", 5, str(tmp_path / "cache"))
    with pytest.raises(UserError, match="needs eval.hellaswag|scores eval.hellaswag"):
        harness.evaluate(ckpt, load_recipe("smoke", ["eval.harness_tasks=[hellaswag_local]"]))
    with pytest.raises(UserError, match="knows no task no_such_task"):
        harness.evaluate(ckpt, load_recipe("smoke", ["eval.harness_tasks=[no_such_task]"]))
