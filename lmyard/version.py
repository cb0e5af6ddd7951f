"""The code version recorded with every run: the git commit when there is one."""

from __future__ import annotations

import functools
import os
import subprocess

from lmyard import __version__


@functools.cache
def code_version() -> str:
    if os.environ.get("LMYARD_CODE_VERSION"):
        return os.environ["LMYARD_CODE_VERSION"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", ""
    return f"{__version__}+g{sha}{'.dirty' if dirty else ''}" if sha else __version__
