"""The backend table (lmyard.backends): a backend is its module and one line of the table; the backend string is
compared nowhere else. tests/fixtures/example_backend adds one from outside lmyard (its table line is an entry
point) and is configured, checked and launched as the built-in ones are."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "example_backend"

_WITH_EXAMPLE = r"""
import json, sys
from lmyard.config_reference import reference_markdown
from lmyard.errors import UserError
from lmyard.launch.launcher import launch
from lmyard.recipes import load_recipe
from lmyard.stages import ExportSpec

out = {}
cfg = load_recipe("smoke", ["launch.backend=example", "launch.example.niceness=7", "launch.nnodes=1"])
out["niceness"] = cfg.launch.example.niceness
out["documented"] = "`launch.example.niceness`" in reference_markdown()
try:
    load_recipe("smoke", ["launch.backend=example", "launch.nnodes=2"])
except UserError as e:
    out["refused"] = str(e)
lines = []
try:
    launch(ExportSpec(config=cfg, source=sys.argv[1], dest=sys.argv[2]), on_line=lines.append)
except UserError as e:
    out["stage_error"] = str(e)
out["lines"] = lines
print(json.dumps(out))
"""


def test_a_backend_from_a_package_is_configured_checked_and_launched_through_its_table_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(FIXTURE), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", _WITH_EXAMPLE, str(tmp_path / "no-such-checkpoint"), str(tmp_path / "hf")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["niceness"] == 7 and got["documented"]
    assert "launch.backend=example runs one node" in got["refused"] and "\n" not in got["refused"]
    assert "example backend: nice -n 7" in got["lines"]  # the fixture's Job ran the stage
    assert got["stage_error"]  # and the stage's own one line came back through the follower


def test_without_the_package_its_backend_is_not_a_choice():
    from lmyard.backends import BACKENDS
    from lmyard.config import RunConfig

    assert "example" not in BACKENDS and {"local", "docker", "ray"} <= set(BACKENDS)
    assert set(RunConfig.model_json_schema()["$defs"]["LaunchConfig"]["properties"]["backend"]["enum"]) == set(BACKENDS)


def _backend_comparisons(path: Path) -> list[str]:
    """`path:line` of each comparison of a `.backend` attribute with a string (==, !=, in)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            reads = any(isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides)
            if reads and any(isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for s in sides):
                found.append(f"{path}:{node.lineno}")
    return found


def test_the_backend_string_is_compared_in_the_table_only():
    found = [
        hit
        for folder in ("lmyard", "flows", "tasks")
        for path in sorted((REPO / folder).rglob("*.py"))
        if not path.is_relative_to(REPO / "lmyard" / "backends")
        for hit in _backend_comparisons(path)
    ]
    assert not found, "ask lmyard.backends.of(config) instead of comparing launch.backend:\n" + "\n".join(found)


def test_the_comparison_scan_sees_a_comparison(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('if cfg.launch.backend == "ray":\n    pass\nok = launch.backend in ("a", "b")\n')
    assert [hit.rsplit(":", 1)[1] for hit in _backend_comparisons(sample)] == ["1", "3"]


# ---------------------------------------------------------------- the Slurm row: what it asks sbatch and srun for


def test_a_slurm_job_asks_for_the_sites_settings_the_signal_before_its_limit_and_no_requeue(tmp_path):
    from lmyard.launch.slurm import batch_script, sbatch_options
    from lmyard.recipes import load_recipe
    from lmyard.stages import ExportSpec

    sets = ["launch.backend=slurm", "launch.nnodes=2", "launch.nproc_per_node=4", "launch.grace_s=90"]
    sets += ["launch.slurm.partition=gpu", "launch.slurm.account=lab", "launch.slurm.time_limit=01:00:00"]
    sets += ["launch.slurm.gpus_per_node=4", "launch.slurm.sbatch_args=['--mem=0']"]
    sets += ["launch.slurm.container_image=registry/lmyard:1", "launch.slurm.container_mounts=['/data:/data']"]
    cfg = load_recipe("smoke", sets)
    spec = ExportSpec(config=cfg, source=str(tmp_path / "ckpt"), dest=str(tmp_path / "hf"))
    opts = sbatch_options(cfg, spec, str(tmp_path))
    for wanted in ("--nodes=1", "--partition=gpu", "--account=lab", "--time=01:00:00", "--gpus-per-node=4"):
        assert wanted in opts, opts
    assert "--signal=TERM@150" in opts and "--no-requeue" in opts and opts[-1] == "--mem=0"
    script = batch_script(cfg, spec, str(tmp_path))
    assert "--container-image=registry/lmyard:1" in script
    assert f"--container-mounts={tmp_path}:{tmp_path},/data:/data" in script
    assert script.rstrip().endswith(f"python3 -m lmyard.launch.slurm_node {tmp_path}")


def test_slurm_settings_that_contradict_the_launch_section_are_refused_when_the_config_loads():
    from lmyard.errors import UserError
    from lmyard.recipes import load_recipe

    with pytest.raises(UserError, match="one rank per GPU"):
        load_recipe("smoke", ["launch.backend=slurm", "launch.nproc_per_node=2", "launch.slurm.gpus_per_node=8"])
    with pytest.raises(UserError, match="container_mounts needs launch.slurm.container_image"):
        load_recipe("smoke", ["launch.backend=slurm", "launch.slurm.container_mounts=['/a:/a']"])
