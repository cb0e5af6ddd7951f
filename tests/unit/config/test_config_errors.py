"""User mistakes on the command line: one line that names the problem, exit 2, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml
from conftest import REPO, lmyard_cmd

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.recipes import load_recipe


def test_smoke_is_the_embedded_default(monkeypatch):
    monkeypatch.delenv("LMYARD_TRAIN__THREADS_PER_RANK", raising=False)  # the suite's one LMYARD_* (conftest)
    assert load_recipe("smoke") == RunConfig()


def test_overrides_reach_nested_fields_with_yaml_types():
    cfg = load_recipe("smoke", ["train.max_steps=50", "train.compile=true", "eval.prompts=[a, b]", "store=/tmp/s"])
    assert (cfg.train.max_steps, cfg.train.compile, cfg.eval.prompts, cfg.store) == (50, True, ["a", "b"], "/tmp/s")


@pytest.mark.parametrize("mode", ["pointwise", "selective", "full"])
def test_checkpointing_the_first_blocks_is_accepted_for_every_mode_that_recomputes(mode):
    cfg = load_recipe("smoke", [f"train.activation_checkpointing={mode}", "train.activation_checkpointing_blocks=2"])
    assert (cfg.train.activation_checkpointing, cfg.train.activation_checkpointing_blocks) == (mode, 2)


@pytest.mark.parametrize(
    "gate", ["eval.gates.val_loss_max=3", "eval.gates.metrics=[{metric: loss/val, max: 3}]", "eval.approval=true"]
)
def test_a_run_that_registers_nothing_refuses_gates_and_approval(gate):
    assert load_recipe("smoke", ["tracking.registry=false"]).tracking.registry is False
    with pytest.raises(UserError, match="act on the registered model: with tracking.registry=false, unset them"):
        load_recipe("smoke", ["tracking.registry=false", gate])


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
        (["config", "--set", "train.lr=.inf"], "train.lr: Input should be a finite number"),
        (["config", "--set", "train.float8_recipe=rowwize"], "train.float8_recipe: Input should be 'tensorwise'"),
        (["config", "--set", "eval.poll_s=.nan"], "eval.poll_s: Input should be a finite number"),
        (["config", "--set", f"run_name={'r' * 300}"], "run_name: 300 characters, at most 100"),
        (["config", "--set", "store=s3://"], "store: 's3://' names no bucket"),
        (["shard", "smoke", "--set", "store=s3:///prefix"], "store: 's3:///prefix' names no bucket"),
        (["config", "--set", "store=gs://bucket/x"], "is not a store URI"),
        (["config", "--set", "train.activation_checkpointing=some"], "train.activation_checkpointing: Input should be"),
        (
            ["config", "--set", "train.fsdp_reshard_after_forward=maybe"],
            "train.fsdp_reshard_after_forward: should be true, false or auto, got 'maybe'",
        ),
        (["config", "--set", "checkpoint.files_per_rank=0"], "checkpoint.files_per_rank: Input should be greater than"),
        (
            ["config", "--set", "train.parallel=fsdp", "--set", "train.residual_dtype=float32"],
            "train.residual_dtype=float32 needs train.parallel=ddp: FSDP2's bf16 weights carry the residual stream",
        ),
        (
            [
                "config",
                "--set",
                "train.activation_checkpointing=none",
                "--set",
                "train.activation_checkpointing_blocks=2",
            ],
            "train.activation_checkpointing_blocks applies to activation_checkpointing=pointwise, selective or full, not none",
        ),
        (
            [
                "config",
                "--set",
                "train.activation_checkpointing=full",
                "--set",
                "train.activation_checkpointing_blocks=9",
            ],
            "train.activation_checkpointing_blocks is 9 but the model has 4 blocks: set at most 4",
        ),
        (
            ["config", "--set", "train.activation_checkpointing_blocks=0"],
            "train.activation_checkpointing_blocks: Input should be greater than 0",
        ),
        (
            ["config", "--set", "eval.gates.metrics=[{metric: loss/val, min: 1, max: 3}]"],
            "eval.gates.metrics.0: gate on 'loss/val' needs exactly one bound: min (higher is better) or max",
        ),
        (["config", "--set", "eval.gates.metrics=[{max: 3}]"], "eval.gates.metrics.0.metric: Field required"),
        (
            ["config", "--set", "launch.ray.runtime_env={env_vars: {NCCL_SOCKET_IFNAME: null}}"],
            "launch.ray.runtime_env: env_vars.NCCL_SOCKET_IFNAME is None, not a string: give it a value, "
            'quoted in YAML (e.g. NCCL_SOCKET_IFNAME: "1")',
        ),
        (
            ["config", "--set", "launch.ray.runtime_env={env_var: {A: b}}"],
            "launch.ray.runtime_env: unknown key 'env_var'; Ray's keys: conda, config",
        ),
    ],
)
def test_bad_config_prints_one_line_and_exits_2(args, message):
    _assert_one_line_exit_2(
        subprocess.run(lmyard_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=60), message
    )


def _assert_one_line_exit_2(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmyard: error:") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_version_prints_the_package_version():
    from lmyard import __version__

    proc = subprocess.run(lmyard_cmd("--version"), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"lmyard {__version__}", proc.stdout + proc.stderr


def test_recipe_that_is_not_utf8_is_named_with_its_byte(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("run_name: caf\u00e9\n".encode("latin-1"))
    proc = subprocess.run(lmyard_cmd("run", str(recipe)), cwd=REPO, capture_output=True, text=True, timeout=60)
    _assert_one_line_exit_2(proc, "is not UTF-8 text (byte 0xe9 at offset 13)")


def test_store_without_write_permission_fails_before_sharding(tmp_path):
    store = tmp_path / "locked"
    store.mkdir(mode=0o555)
    cmd = lmyard_cmd("shard", "smoke", "--set", f"store={store}")
    if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that bypass file permissions
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    _assert_one_line_exit_2(proc, f"store {store} is not writable (Permission denied)")
    assert not list(store.iterdir())


def test_environment_sets_fields_under_recipe_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_steps: 7\n")
    env = {
        **os.environ,
        "LMYARD_STORE": str(tmp_path / "site-store"),
        "LMYARD_TRAIN__MAX_STEPS": "99",
        "lmyard_train__lr": "0.01",
        "LMYARD_EVAL__PROMPTS": '["Once upon"]',
    }
    args = ["config", str(recipe), "--set", "train.lr=0.5"]
    proc = subprocess.run(lmyard_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["store"] == str(tmp_path / "site-store")  # the environment over the default
    assert cfg["train"]["max_steps"] == 7  # the recipe over the environment
    assert cfg["train"]["lr"] == 0.5  # --set over both
    assert cfg["eval"]["prompts"] == ["Once upon"]


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("LMYARD_TRAIN__MAX_STEPZ", "5", "unknown config key 'train.max_stepz' (from LMYARD_TRAIN__MAX_STEPZ)"),
        ("LMYARD_TRAIN__LR", "inf", "train.lr (from LMYARD_TRAIN__LR): Input should be a finite number"),
        ("LMYARD_EVAL__PROMPTS", "[a", "LMYARD_EVAL__... is not valid: lists and mappings are given as JSON"),
    ],
)
def test_bad_environment_value_names_its_variable(name, value, message):
    env = {**os.environ, name: value}
    proc = subprocess.run(lmyard_cmd("config"), cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    _assert_one_line_exit_2(proc, message)


def test_unknown_tokenizer_is_a_user_error():
    from lmyard.data.tokenizer import get_tokenizer

    with pytest.raises(UserError, match="unknown tokenizer 'gpt5'"):
        get_tokenizer(load_recipe("smoke", ["tokenizer.name=gpt5"]).tokenizer)


def test_config_reference_in_docs_is_generated_from_the_model():
    from lmyard.config_reference import reference_markdown

    assert (REPO / "docs" / "config.md").read_text().strip() == reference_markdown().strip(), (
        "docs/config.md is stale: run `lmyard config --reference > docs/config.md`"
    )


def test_deployment_recipe_sits_over_the_environment_and_under_explicit_fields(monkeypatch):
    from lmyard.recipes import with_recipe

    monkeypatch.setenv("LMYARD_TRACKING__EXPERIMENT", "site")
    monkeypatch.setenv("LMYARD_RUN_NAME", "from-env")
    monkeypatch.setenv("LMYARD_TRAIN__MAX_STEPS", "9")
    cfg = with_recipe(RunConfig.model_validate({"train": {"max_steps": 5}}), "smoke-deployment")
    assert cfg.tracking.experiment == "site"  # the environment fills what the recipe leaves out
    assert cfg.run_name == "smoke-deployment"  # the recipe wins over the environment
    assert cfg.train.max_steps == 5  # the deployment's explicit field wins over both


def test_the_runtime_env_keys_lmyard_accepts_are_rays():
    ray_env = pytest.importorskip("ray.runtime_env")
    from lmyard.backends.ray import RUNTIME_ENV_KEYS

    public = {k.removeprefix("_") for k in ray_env.RuntimeEnv.known_fields if k in ("_nsight", "_rocprof_sys")}
    assert RUNTIME_ENV_KEYS == public | {k for k in ray_env.RuntimeEnv.known_fields if not k.startswith("_")}
