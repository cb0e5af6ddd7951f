"""Each failure said once: a run whose retries are spent says its error once, each attempt once, and its last line is
lmyard's one line (refusals before a run: tests/unit/house/test_refusals.py)."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO, lmyard_cmd, tiny_overrides

# ---------------------------------------------------------------- each failure said once


def _run(overrides: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        lmyard_cmd("run", "smoke", *[x for o in overrides for x in ("--set", o)]),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _ends_with_its_one_line(out: str) -> str:
    """The output's last line, lmyard's `lmyard: error:` line, with no dump before it from Prefect."""
    last = out.strip().splitlines()[-1]
    assert last.startswith("lmyard: error: "), out[-3000:]
    assert out.count("lmyard: error:") == 1, out[-3000:]
    for dump in ("Traceback", "Encountered exception", "Finished in state Failed", "Last lines:"):
        assert dump not in out, f"{dump!r} in:\n{out[-3000:]}"
    return last.removeprefix("lmyard: error: ")


def test_a_crash_with_its_retries_spent_ends_in_its_one_line_and_says_each_attempt_once(cli_env, tmp_path):
    overrides = tiny_overrides(tmp_path, steps=4, **{"run_name": "crashing", "launch.retries": 1})
    done = _run(overrides, {**cli_env, "LMYARD_FAULTS": "crash@2"})  # every attempt crashes after step 2
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    error = _ends_with_its_one_line(done.stderr)
    # every rank crashes: the first named with its own last line, the other after it
    assert re.fullmatch(
        r"train: rank (\d) exited with code 1 first: injected crash after step 2; rank \d failed after it", error
    ), error
    assert out.count("injected crash after step 2") >= 2  # the failed ranks' last lines, as they printed them
    assert out.count("exited with code 1 first") == 2, out[-3000:]  # the first attempt's, with its retry; the last line
    assert out.count("retry 1/1 starts") == 1
