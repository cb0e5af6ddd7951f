"""lmyard.stages.runtime.exit_fast: how a stage process, torchrun's agent and a warm standby end. Python's shutdown
still runs (threads joined, atexit callbacks), the code is main's, and the interpreter's teardown is skipped."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from conftest import REPO


def _run(body: str, tmp_path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import atexit, sys, threading, time
        from lmyard.stages.runtime import exit_fast
        OUT = sys.argv[1]
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_a_main_returning_3_exits_3_after_its_late_thread_and_its_atexit_callbacks_wrote_their_lines(tmp_path):
    ran = _run(
        """
        def late():
            time.sleep(0.5)
            open(OUT, "a").write("thread\\n")

        def main():
            atexit.register(lambda: open(OUT, "a").write("atexit\\n"))
            threading.Thread(target=late).start()  # not a daemon: Python waits for it
            print("said", end="")  # no newline: flushed at the end all the same
            return 3

        exit_fast(main)
        """,
        tmp_path,
    )
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout == "said"
    assert (tmp_path / "out").read_text() == "thread\natexit\n"


def test_sys_exit_inside_main_keeps_its_code_and_its_message(tmp_path):
    two = _run("exit_fast(lambda: sys.exit(2))", tmp_path)
    assert two.returncode == 2, two.stderr
    said = _run("exit_fast(lambda: sys.exit('no such recipe: x'))", tmp_path)
    assert said.returncode == 1 and said.stderr.strip() == "no such recipe: x"


def test_an_exception_out_of_main_prints_its_traceback_and_exits_1(tmp_path):
    ran = _run("def main():\n    raise ValueError('broken')\nexit_fast(main)", tmp_path)
    assert ran.returncode == 1
    assert "Traceback" in ran.stderr and "ValueError: broken" in ran.stderr


def test_a_keyboard_interrupt_out_of_main_ends_the_process_by_sigint_as_python_does(tmp_path):
    ran = _run("def main():\n    raise KeyboardInterrupt\nexit_fast(main)", tmp_path)
    assert ran.returncode == -signal.SIGINT, (ran.returncode, ran.stderr)


def test_a_second_exit_fast_in_the_same_process_ends_it_with_the_last_code(tmp_path):
    """A warm standby runs a rank's `__main__` inside its own: one callback, the code set by whichever ran last."""
    ran = _run(
        """
        def rank():
            return 5

        def standby():
            try:
                exit_fast(rank)
            except SystemExit as e:
                return e.code + 1

        exit_fast(standby)
        """,
        tmp_path,
    )
    assert ran.returncode == 6, ran.stderr
