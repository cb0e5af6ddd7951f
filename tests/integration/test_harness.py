"""lm-evaluation-harness on the exported model: lm-eval's multiple-choice scoring of the local HellaSwag
examples gives lmyard's own HellaSwag acc and acc_norm on the same model."""

from __future__ import annotations

import json
import random

import pytest
from conftest import lmyard_cmd, tiny_overrides, write_random_checkpoint

from lmyard.checkpoint.resume import load_step
from lmyard.config import TokenizerConfig
from lmyard.data.tokenizer import get_tokenizer
from lmyard.evaluate import evals, harness
from lmyard.models.registry import model_from_checkpoint
from lmyard.recipes import load_recipe
from lmyard.run import Run
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


@pytest.mark.integration
def test_lm_eval_hellaswag_gives_lmyards_acc_and_acc_norm(tmp_path):
    data = tmp_path / "hellaswag.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in _examples(24)))
    uri, _ = write_random_checkpoint(tmp_path / "store", seed=3)
    cfg = load_recipe("smoke", [f"eval.hellaswag={data}", "eval.harness_tasks=[hellaswag_local]"])
    ckpt = load_step(Run("r", open_store(str(tmp_path / "store"))), 5, str(tmp_path / "cache"))

    ours = evals.hellaswag(
        model_from_checkpoint(ckpt), get_tokenizer(TokenizerConfig(name="bytes")), evals.read_hellaswag(str(data))
    )
    theirs = harness.evaluate(ckpt, cfg)["metrics"]
    assert ours.acc != ours.acc_norm  # the two rules pick different endings here: both are tested
    assert theirs["hellaswag_local/acc"] == pytest.approx(ours.acc, abs=1e-9)
    assert theirs["hellaswag_local/acc_norm"] == pytest.approx(ours.acc_norm, abs=1e-9)


@pytest.mark.integration
def test_harness_names_what_is_missing(tmp_path):
    from lmyard.errors import UserError

    uri, _ = write_random_checkpoint(tmp_path / "store")
    ckpt = load_step(Run("r", open_store(str(tmp_path / "store"))), 5, str(tmp_path / "cache"))
    with pytest.raises(UserError, match="needs eval.hellaswag|scores eval.hellaswag"):
        harness.evaluate(ckpt, load_recipe("smoke", ["eval.harness_tasks=[hellaswag_local]"]))
    with pytest.raises(UserError, match="knows no task no_such_task"):
        harness.evaluate(ckpt, load_recipe("smoke", ["eval.harness_tasks=[no_such_task]"]))


def _task_yaml(folder, name: str, data_file) -> None:
    """A multiple-choice lm-eval task over a local JSONL of {ctx, endings, label} (JSON is YAML)."""
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(data_file)}},
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "doc_to_text": "{{ctx}}",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "{{endings}}",
        "metric_list": [{"metric": "acc"}],
    }
    (folder / f"{name}.yaml").write_text(json.dumps(task))


@pytest.mark.integration
def test_harness_check_passes_a_local_task_and_names_one_whose_data_cannot_load(tmp_path):
    from lmyard.errors import UserError

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in _examples(4)))
    _task_yaml(tasks, "local_qa", data)
    _task_yaml(tasks, "lost_qa", tmp_path / "missing.jsonl")
    include = f"eval.harness_include={tasks}"
    harness.check_tasks(load_recipe("smoke", ["eval.harness_tasks=[local_qa]", include]).eval)
    with pytest.raises(
        UserError, match=r"task lost_qa cannot be loaded offline here .*drop it from eval.harness_tasks"
    ):
        harness.check_tasks(load_recipe("smoke", ["eval.harness_tasks=[local_qa,lost_qa]", include]).eval)


@pytest.mark.slow
def test_a_harness_task_that_cannot_load_offline_stops_the_run_before_sharding_or_training(cli_env, tmp_path):
    """lm-eval's arc_easy needs its hub dataset: offline, with no local copy, the run ends at once with exit 2
    and one line naming the task and how to supply it, not after all its training."""
    import subprocess

    overrides = tiny_overrides(tmp_path, **{"eval.harness_tasks": "[arc_easy]"})
    done = subprocess.run(
        lmyard_cmd("run", "smoke", *[x for o in overrides for x in ("--set", o)]),
        env={**cli_env, "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")},  # no local copy of ai2_arc
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("lmyard: error:")]
    assert len(errors) == 1 and "task arc_easy cannot be loaded offline" in errors[0], done.stderr[-3000:]
    assert "eval.harness_include" in errors[0] and "drop it from eval.harness_tasks" in errors[0]
    assert not (tmp_path / "store" / "shards").exists() and not (tmp_path / "store" / "runs").exists()
