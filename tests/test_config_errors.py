"""User mistakes on the command line: one line that names the problem, exit 2, no traceback."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, lmyard_cmd

from lmyard.config import RunConfig, load_recipe
from lmyard.errors import UserError


def test_smoke_is_the_embedded_default():
    assert load_recipe("smoke") == RunConfig()


def test_overrides_reach_nested_fields_with_yaml_types():
    cfg = load_recipe("smoke", ["train.max_steps=50", "train.compile=true", "eval.prompts=[a, b]", "store=/tmp/s"])
    assert (cfg.train.max_steps, cfg.train.compile, cfg.eval.prompts, cfg.store) == (50, True, ["a", "b"], "/tmp/s")


def test_recipe_file_is_read_and_overridden(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_name: r1\ntrain:\n  max_steps: 7\n")
    cfg = load_recipe(str(recipe), ["train.lr=0.01"])
    assert (cfg.run_name, cfg.train.max_steps, cfg.train.lr) == ("r1", 7, 0.01)


@pytest.mark.parametrize(
    "args, message",
    [
        (["config", "nonesuch"], "unknown recipe 'nonesuch'"),
        (["config", "--set", "train.max_stepz=5"], "unknown config key 'train.max_stepz'"),
        (["config", "--set", "train.max_steps=many"], "train.max_steps: Input should be a valid integer"),
        (["config", "--set", "train.lr=-1"], "train.lr: Input should be greater than 0"),
        (["config", "--set", "noequals"], "expected dotted.key=value"),
        (["config", "--set", "model.n_embd=100", "--set", "model.n_head=3"], "multiple of model.n_head"),
    ],
)
def test_bad_config_prints_one_line_and_exits_2(args, message):
    proc = subprocess.run(lmyard_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmyard: error:") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unknown_tokenizer_is_a_user_error():
    from lmyard.data.tokenizer import get_tokenizer

    with pytest.raises(UserError, match="unknown tokenizer 'gpt5'"):
        get_tokenizer(load_recipe("smoke", ["tokenizer.name=gpt5"]).tokenizer)


def test_config_reference_in_docs_is_generated_from_the_model():
    from lmyard.config import reference_markdown

    assert (REPO / "docs" / "config.md").read_text().strip() == reference_markdown().strip(), (
        "docs/config.md is stale: run `lmyard config --reference > docs/config.md`"
    )
