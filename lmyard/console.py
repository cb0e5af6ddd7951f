"""What `lmyard run` and `lmyard shard` print for a person at a terminal: the one place that shapes it.

Design notes: docs/cli.md, `lmyard/console.py`.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import re
import shutil
import sys
import textwrap
import threading
import time
from typing import Any, TextIO

_console: Console | None = None

# Prefect's task run names are the task's name with a random suffix (`train-6b9`); named runs keep their name
_RUN_SUFFIX = re.compile(r"-[0-9a-f]{3}$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_CODE = tuple(os.path.join(_ROOT, package) + os.sep for package in ("lmyard", "flows", "tasks"))
_QUIET_LOGGERS = ("mlflow", "alembic", "urllib3", "botocore", "httpx")


class Console(logging.Handler):
    """A logging handler that prints records for a person (see the module docstring)."""

    def __init__(self, store: str, stream: TextIO | None = None, bars: bool | None = None):
        super().__init__()
        self.stream = stream or sys.stderr
        self.bars_on = self.stream.isatty() if bars is None else bars
        self._stores = _store_prefixes(store)
        self._bars: dict[str, Any] = {}  # tqdm bars by name
        self._lock = threading.RLock()
        self._held: tuple[str, str, str] | None = None  # a failure not printed yet: its headline, line, task
        self._said: set[str] = set()  # the headlines of failures printed

    # ---- lines
    def emit(self, record: logging.LogRecord) -> None:
        try:
            failure = _failure(record)
            if failure is not None:
                self._failed(record, *failure)
                return
            text = self.line(record)
            if text is not None:
                if self._held is not None and self._held[2] != _who(record):
                    self._release()  # another task or the flow goes on: the failure was not the run's end
                self.write(text)
        except Exception:
            self.handleError(record)

    # ---- failures: each said once
    def _failed(self, record: logging.LogRecord, scope: str, said: str, suffix: str = "") -> None:
        """A failure is said by the stage (its `lmyard: error:` line), the task (its failure, its state), the
        flow (its exception, its state) and the command line's last line. Here it prints once: a stage's or a
        task's failure as one line, held back until a line of another task or of the flow shows the run goes on
        (else the command line's last line says it, see `settle`); the flow's lines of it print nothing; a
        retried attempt's failure prints with its retry. A traceback (an error outside lmyard's) prints once."""
        held = self._held[0] if self._held is not None else None
        if scope == "flow" and (not record.exc_info or said in self._said):
            return
        if scope in ("task", "stage") and (said in self._said or said == held):
            return
        if scope == "retry" and said == held:
            self._held = None  # said now, with its retry
        self._release()
        keep = {"exc_info": record.exc_info if said not in self._said else None, "exc_text": None, "args": None}
        text = self.line(logging.makeLogRecord({**record.__dict__, **keep, "msg": f"failed: {said}{suffix}"}))
        if text is None:
            return
        if scope in ("task", "stage") and not record.exc_info:
            self._held = (said, text, _who(record))
        else:
            self.write(text)
            self._said.add(said)

    def _release(self) -> None:
        if self._held is not None:
            said, text, _ = self._held
            self._held = None
            self.write(text)
            self._said.add(said)

    def settle(self, error: BaseException | None) -> None:
        """The run ended (with `error`, which the command line's last line says): a held failure line that says
        the same prints nothing, any other prints now."""
        with self.lock or contextlib.nullcontext():  # emit() holds it too: Prefect logs from its own threads
            if error is not None and self._held is not None and self._held[0] == headline(error):
                self._held = None
            self._release()

    def line(self, record: logging.LogRecord) -> str | None:
        """The record as printed, or None for chatter a person does not need."""
        message = _ANSI.sub("", record.getMessage())
        if record.name == "py.warnings" and not message.startswith(_OWN_CODE):
            return None  # a library's warning ("path.py:12: UserWarning: ...")
        if record.levelno < logging.WARNING and _is_chatter(record, message):
            return None
        if record.exc_info:  # a crash's traceback (the command line drops those of user errors)
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        for prefix in self._stores:
            message = message.replace(prefix, "")
        level = record.levelname.lower()
        if record.levelno >= logging.WARNING and not message.lower().startswith(level):
            message = f"{level}: {message}"
        head = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {_who(record)}: "
        first, *rest = message.splitlines() or [""]
        return head + first + "".join("\n" + " " * 4 + ln for ln in rest)

    def write(self, text: str) -> None:
        with self._lock:
            if self._bars:
                from tqdm import tqdm

                tqdm.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

    # ---- bars
    def progress(self, name: str, done: float, total: float | None, text: str = "") -> None:
        if not self.bars_on:
            return
        from tqdm import tqdm

        with self._lock:
            bar = self._bars.get(name)
            if bar is None:
                unit = "step" if name == "train" else "%"
                # a share of the input: the percentage and the ETA, not "37.5/100.0 [..., 2.1%/s]"
                shape = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]" if unit == "%" else None
                # the terminal's size, else COLUMNS/LINES or 80x24: tqdm draws nothing on one that reports 0 rows
                size = shutil.get_terminal_size()
                bar = tqdm(
                    total=total,
                    initial=done,
                    desc=name,
                    unit=unit,
                    bar_format=shape if total is not None else None,
                    file=self.stream,
                    ncols=size.columns,
                    nrows=size.lines,
                )
                self._bars[name] = bar
            bar.update(done - bar.n)
            if text:
                bar.set_postfix_str(text, refresh=False)
            bar.refresh()
            if total is not None and done >= total:
                bar.close()
                del self._bars[name]

    def close(self) -> None:
        with self._lock:
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()
        super().close()


def _store_prefixes(store: str) -> list[str]:
    """The forms a store's location takes in messages, longest first, each with its trailing slash."""
    if "://" in store and not store.startswith("file://"):
        return [store.rstrip("/") + "/"]
    path = os.path.abspath(store.removeprefix("file://"))
    return sorted({f"file://{path}/", f"{path}/", store.rstrip("/") + "/"}, key=len, reverse=True)


def _who(record: logging.LogRecord) -> str:
    task, run = getattr(record, "task_name", None), getattr(record, "task_run_name", None)
    if run:
        return task if task and _RUN_SUFFIX.sub("", run) == task else run
    return getattr(record, "flow_name", None) or "lmyard"


_RETRY = "Task run failed with %s: %r - Retry %s/%s will start %s"  # Prefect's task engine
_FAILED_STATE = re.compile(r"Finished in state Failed\((?P<quoted>'.*'|\".*\")\)$", re.S)
_STAGE_ERROR = re.compile(r"^(?:\[node \d+\] )?lmyard: error: (?P<message>.*)$", re.S)  # lmyard.stages.run_stage
_EXCEPTION = re.compile(r"^(?:Task|Flow) run encountered an exception:? (?:[\w.]+: )?", re.S)


def headline(error: object) -> str:
    """An error as one line: its message's first line. The "last lines" a stage's failure carries (what its
    output said last) are on the lines above it already, as the run printed them."""
    text = str(error).strip() or type(error).__name__
    first, _, rest = text.partition("\n")
    first = re.sub(r"[.;:]?\s*last lines:?\s*$", "", first.strip(), flags=re.IGNORECASE)
    return first + (" (its last lines are above)" if rest.strip() else "")


def _failure(record: logging.LogRecord) -> tuple[str, str, str] | None:
    """(scope, headline, suffix) for a line about a failure: `stage` (a stage's own `lmyard: error:` line),
    `retry` (a task's attempt failed and is retried: the suffix says when), `task` (a task failed) or `flow`
    (the flow failed); None for any other record."""
    if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")) or record.levelno < logging.INFO:
        return None
    message, args = str(record.msg), record.args
    if message == _RETRY and isinstance(args, tuple) and len(args) == 5:
        return "retry", headline(args[1]), f"; retry {args[2]}/{args[3]} starts {args[4]}"
    error = record.exc_info[1] if record.exc_info else getattr(record, "error", None)  # without its traceback
    scope = "task" if record.name.startswith("prefect.task_runs") else "flow"
    stage = _STAGE_ERROR.match(message) if scope == "task" and not args else None
    if stage is not None:
        return "stage", headline(stage["message"]), ""
    if message.startswith("Task run failed with ") and error is not None:
        return "task", headline(error), ""
    if message.startswith("Encountered exception during execution") and error is not None:
        return "flow", headline(error), ""
    state = _FAILED_STATE.match(message)
    if state is None:
        return None
    try:
        text = ast.literal_eval(state["quoted"])
    except (ValueError, SyntaxError):
        text = state["quoted"][1:-1]
    return scope, headline(_EXCEPTION.sub("", str(text))), ""


def _is_chatter(record: logging.LogRecord, message: str) -> bool:
    if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
        return True  # Prefect's own INFO lines (the temporary server and its hints), libraries' INFO lines
    return message.startswith("Finished in state Completed(")


def install(store: str, stream: TextIO | None = None) -> Console:
    """Print what Prefect's loggers print through a Console (in place of Prefect's console handler), quiet other
    tools here and in the processes this one starts. For the command line, before it runs a flow."""
    global _console
    quiet_tools()
    # Python warnings become records of `py.warnings`, and `line` keeps only lmyard's own: a filter would not do,
    # as MLflow shows its (colored) UserWarnings under a "once" filter of its own
    logging.captureWarnings(True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__name__ == "PrefectConsoleHandler":
            root.removeHandler(handler)
    _console = Console(store, stream)
    root.addHandler(_console)
    return _console


def quiet_tools() -> None:
    """MLflow, its database migrations and the storage clients say only their errors, here and in the processes
    this one starts (an operator command's one line stays the only one)."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")  # read by MLflow here and in the trainer's processes
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # MLflow's own bars, in a log too
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def settle(error: BaseException | None) -> None:
    """The run ended, with `error` or none: see Console.settle. A no-op where no console is installed."""
    if _console is not None:
        _console.settle(error)


def progress(name: str, done: float, total: float | None, text: str = "") -> None:
    """Report progress of `name` (`tokenize`, `train`): a bar on a terminal, nothing elsewhere."""
    if _console is not None:
        _console.progress(name, done, total, text)


def sample_text(step: int, prompt: str, completion: str, max_chars: int = 400) -> str:
    """A generated sample as text a person reads: the prompt, then the completion as it came, on indented lines."""
    text = completion if len(completion) <= max_chars else completion[:max_chars] + " ..."
    return f"step {step} sample after {prompt!r}:\n" + textwrap.indent(prompt + text, "| ", lambda _: True)


def where_next(tracking_uri: str, run_id: str, model: str | None) -> str:
    """The last line of a run: the MLflow UI to open (the command that starts it, for a local database) and the
    registered model's URI."""
    from lmyard.config import redact_uri

    uri = redact_uri(tracking_uri)
    ui = (
        f"open {uri} (run {run_id})"
        if uri.startswith(("http://", "https://"))
        else f"{mlflow_command()} ui --backend-store-uri {uri}"
    )
    return f"look at it: {ui}" + (f"; the model: models:/{model}" if model else "")


def mlflow_command() -> str:
    """The `mlflow` installed beside the Python that runs lmyard, as a shell here calls it: `mlflow` when PATH finds
    that one (an activated virtualenv), else its path, relative to the working folder when under it (after
    `.venv/bin/lmyard run smoke`: `.venv/bin/mlflow`)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mlflow")
    found = shutil.which("mlflow")
    if not os.path.isfile(beside) or (found and os.path.samefile(found, beside)):
        return "mlflow"
    relative = os.path.relpath(beside)
    if relative.startswith(".."):
        return beside
    return relative if os.sep in relative else os.path.join(".", relative)
