"""lmyard installed, not cloned: a wheel of this checkout, installed on its own and run from another folder, knows
every recipe it ships, and a site's environment reaches each of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO

pytestmark = pytest.mark.integration  # builds a wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, list[str]]:
    """(the folder the wheel is installed in, the recipe names it ships)."""
    tmp = tmp_path_factory.mktemp("package")
    # the build writes build/ and *.egg-info beside the sources: build a copy, not the checkout
    source = tmp / "source"
    ignore = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "*.egg-info", ".lmyard", "__pycache__", "tests")
    shutil.copytree(REPO, source, ignore=ignore)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = tmp.glob("lmyard-*.whl")
    names = sorted(Path(n).stem for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lmyard/recipes/"))
    names = [n for n in names if n != "__init__"]
    site = tmp / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return site, names


def _lmyard(site: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The installed package's command line (its dependencies from this interpreter), away from the checkout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMYARD_")}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(site), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_installed_wheel_lists_and_resolves_every_shipped_recipe_from_another_folder(installed, tmp_path):
    site, names = installed
    assert {"gpt2-124m", "llama-1b", "llama-8b", "smoke-deployment", "smoke-ray"} <= set(names)
    where = subprocess.run(
        [sys.executable, "-c", "import lmyard; print(lmyard.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's lmyard, not the checkout's
    unknown = _lmyard(site, tmp_path, "config", "no-such-recipe")
    assert unknown.returncode == 2 and all(n in unknown.stderr for n in names), unknown.stderr
    for name in names:
        done = _lmyard(site, tmp_path, "config", name)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"


def test_a_sites_store_tracking_uri_and_max_steps_reach_every_shipped_recipe_that_does_not_set_them(
    installed, tmp_path
):
    site, names = installed
    env = {
        "LMYARD_STORE": "s3://site-bucket/lmyard",
        "LMYARD_TRACKING__URI": "http://mlflow.site:5000",
        "LMYARD_TRAIN__MAX_STEPS": "50",
    }
    for name in names:
        recipe = yaml.safe_load((site / "lmyard" / "recipes" / f"{name}.yaml").read_text()) or {}
        done = _lmyard(site, tmp_path, "config", name, **env)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        config = yaml.safe_load(done.stdout)
        assert "store" not in recipe and config["store"] == env["LMYARD_STORE"], name
        assert "uri" not in (recipe.get("tracking") or {}) and config["tracking"]["uri"] == env["LMYARD_TRACKING__URI"]
        expected = (recipe.get("train") or {}).get("max_steps", 50)  # a recipe that sets it keeps it
        assert config["train"]["max_steps"] == expected, name
