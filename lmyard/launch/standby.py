"""Warm standbys: while an attempt trains, a process per rank of this node (and one for torchrun) imports torch,
its compiler and the train stage; the next attempt's torchrun and ranks start in them, not in fresh interpreters.

    pool = standby.pool()       # the launcher's: env[STANDBY_ENV] = pool.folder; prestart(n, env); refill(n + 1, env)
    python -m lmyard.launch.standby --agent ARGS # the launcher's child: `python -m lmyard.launch.torchrun ARGS`,
                                                 # in a waiting standby (its streams, signals, exit code) or here
    python -m lmyard.launch.standby STAGE ARGS   # torchrun's child: `python -m lmyard.stages STAGE ARGS`, likewise
    python -m lmyard.launch.standby --serve PATH # a standby: warm up, wait for one process to take over, run it

prestart: a node's first attempt's, beside torchrun, for its ranks to wait for. A standby refuses a rank whose
environment differs in what is read at import (`differs`); it ends with the launcher or the rank (docs/launch.md).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

STANDBY_ENV = "LMYARD_STANDBY"  # the folder of this node's standby sockets, in the ranks' environment
RANK, AGENT = "lmyard.stages", "lmyard.launch.torchrun"  # what a standby runs: a rank, or torchrun's agent
# what may differ between the environment a standby was started with and the rank's: torchrun's per-rank
# variables and lmyard's per-attempt ones, read when the stage runs; anything else (a cache folder, a thread
# count, a compiler setting) is read at import, so a standby of another environment is not used
PER_RANK = frozenset(
    {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    | {"GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    | {"NCCL_ASYNC_ERROR_HANDLING", "CUDA_MODULE_LOADING"}
)
PER_RANK_PREFIXES = ("LMYARD_", "TORCHELASTIC_", "TORCH_ELASTIC_")


def differs(started: dict[str, str], rank: dict[str, str]) -> list[str]:
    """The variables set differently in `rank` than in `started` that a standby cannot take (sorted)."""
    keys = (set(started) | set(rank)) - PER_RANK
    return sorted(k for k in keys if not k.startswith(PER_RANK_PREFIXES) and started.get(k) != rank.get(k))


def wanted(standby: bool | None, device: str) -> bool:
    """launch.standby: on, off, or (None) on when training would run on this node's NVIDIA GPUs."""
    if standby is not None:
        return standby
    return device != "cpu" and os.path.exists("/dev/nvidiactl")


@dataclass
class _Standby:
    proc: subprocess.Popen
    name: str  # its socket is <folder>/<name>.sock once warm; <name>.taken once a rank has it
    env: dict[str, str]


@dataclass
class Pool:
    """The standbys this process started (children of it: they end with it, see `serve`)."""

    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="lmyard-standby-"))
    standbys: list[_Standby] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def waiting(self) -> list[_Standby]:
        """Standbys alive that no rank has taken (warming up, or warm)."""
        return [
            s
            for s in self.standbys
            if s.proc.poll() is None and not os.path.exists(os.path.join(self.folder, f"{s.name}.taken"))
        ]

    def refill(self, n: int, env: dict[str, str]) -> int:
        """Called as an attempt of `n` ranks launches: `n` standbys for the next one besides those warm now, which
        this attempt's ranks take; each started with `env` (the launch's environment); those of another
        environment are stopped. How many were started."""
        with self.lock:
            self.standbys = [s for s in self.standbys if s.proc.poll() is None]
            for s in self.waiting():
                if differs(s.env, env):
                    s.proc.kill()
            waiting = [s for s in self.waiting() if not differs(s.env, env)]
            warm = [s for s in waiting if os.path.exists(os.path.join(self.folder, f"{s.name}.sock"))]
            missing = n - (len(waiting) - min(n, len(warm)))
            for _ in range(max(0, missing)):
                self.standbys.append(self._start(env))
            return max(0, missing)

    def prestart(self, n: int, env: dict[str, str]) -> int:
        """Called as an attempt of `n` ranks launches, before its torchrun: where no standby of `env` is waiting
        (the node's first attempt, another environment), `n` started now, which its ranks wait for (`take_over`)
        while torchrun starts. How many were started."""
        with self.lock:
            if any(not differs(s.env, env) for s in self.waiting()):
                return 0
        return self.refill(n, env)

    def _start(self, env: dict[str, str]) -> _Standby:
        name = uuid.uuid4().hex[:12]
        with open(os.path.join(self.folder, f"{name}.log"), "ab") as log:  # its own errors, if it fails to warm
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "lmyard.launch.standby", "--serve", os.path.join(self.folder, name)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl-C reaches the rank through the one torchrun started, once
            )
        pid_path = os.path.join(self.folder, f"{name}.pid")  # a rank waits for it while it lives (`_started`)
        with open(pid_path + ".tmp", "w") as f:
            f.write(str(proc.pid))
        os.replace(pid_path + ".tmp", pid_path)
        return _Standby(proc, name, dict(env))

    def close(self) -> None:
        """Stop every standby, waiting or serving a rank, and remove the folder."""
        with self.lock:
            for s in self.standbys:
                with contextlib.suppress(OSError):
                    s.proc.kill()
                    s.proc.wait(timeout=10)
            self.standbys = []
            shutil.rmtree(self.folder, ignore_errors=True)


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> Pool:
    """This process's pool, made on first use and closed at exit."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = Pool()
            atexit.register(_POOL.close)
        return _POOL


def close() -> None:
    """Stop this process's standbys now (a test's end, a launcher that launches nothing more)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            atexit.unregister(_POOL.close)
            _POOL = None


# ---------------------------------------------------------------- the rank's side and the standby's

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# not AGENT: runpy runs it as __main__, and warns of a module imported already
WARM: tuple[str, ...] = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.run")
WARM += ("lmyard.stages.entry", "lmyard.train.stage")
WARM_WAIT_S = 300.0  # the longest a rank waits for a standby that still warms up (then it starts cold)


def take_over(module: str, argv: list[str]) -> int:
    """`python -m MODULE ARGV` (RANK or AGENT): in a standby when one takes it, else in this process (exec). A
    rank also waits for a standby still warming up (started before this process: it is ahead of a cold start);
    torchrun only takes a warm one (its own imports are shorter than a standby's)."""
    started = time.time()
    folder = os.environ.get(STANDBY_ENV)
    with contextlib.suppress(_Refused):  # said once; the others were started alike
        for base in _started(folder) if folder else []:
            if module != RANK and not os.path.exists(base + ".sock"):
                continue
            claim = _claim(base)
            if claim is None or not _warm(base):
                if claim is not None:
                    claim.close()
                continue
            code = _hand_over(base, claim, module, argv, started)
            if code is not None:
                return code
    os.execv(sys.executable, [sys.executable, "-u", "-m", module, *argv])


class _Refused(Exception):
    """A standby refused to take over (another environment, or it ended): this process runs cold."""


def _started(folder: str) -> list[str]:
    """The standbys of `folder` not taken yet (their paths without a suffix): the warm ones first, then the
    others in the order they were started."""
    bases = [p.removesuffix(".pid") for p in glob.glob(os.path.join(folder, "*.pid"))]
    waiting = []
    for base in bases:
        with contextlib.suppress(OSError):
            waiting.append((not os.path.exists(base + ".sock"), os.path.getmtime(base + ".pid"), base))
    return [base for *_, base in sorted(waiting) if not os.path.exists(base + ".taken")]


def _claim(base: str):
    """The standby's claim, held by this process until it ends; None when another process holds it."""
    claim = open(base + ".claim", "a")
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        claim.close()
        return None
    return claim


def _warm(base: str, timeout_s: float = WARM_WAIT_S) -> bool:
    """Whether the standby at `base` is warm (its socket there), waiting while it warms up and lives."""
    import psutil

    deadline = time.monotonic() + timeout_s
    try:
        proc = psutil.Process(int(open(base + ".pid").read()))
    except (OSError, ValueError, psutil.Error):
        return False
    while not os.path.exists(base + ".sock"):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or time.monotonic() > deadline:
                return False
        except psutil.Error:
            return False
        time.sleep(0.05)
    return True


def _hand_over(base: str, claim, module: str, argv: list[str], started: float) -> int | None:
    """The standby at `base`, claimed, runs `module`: its exit code; None when it cannot be reached (the next one
    may serve). Raises _Refused after one line when it refuses."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(30)
        conn.connect(base + ".sock")
        body = {"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "started": started}
        socket.send_fds(conn, [json.dumps(body).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(65536) or b"{}")
    except (OSError, ValueError):
        claim.close()
        return None
    if "pid" not in reply:
        print(f"warm standby not used: {reply.get('refused', 'it ended')}", file=sys.stderr, flush=True)
        claim.close()
        raise _Refused
    pid = int(reply["pid"])
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: _forward(pid, s))
    conn.settimeout(None)
    while True:
        try:
            end = conn.recv(65536)
            break
        except InterruptedError:
            continue
    if not end:  # the standby died without a word: a signal (the OOM killer, a kill -9) ended it
        os.kill(os.getpid(), signal.SIGKILL)
    return int(json.loads(end)["exit"])


def _forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str) -> int:
    """A standby: warm up, wait for one process to take over (while the launcher lives), run it; its exit code."""
    import importlib

    started = dict(os.environ)  # what the imports read (they may set defaults of their own)
    for name in WARM:
        importlib.import_module(name)
    launcher = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".warming")
    listener.listen(1)
    os.rename(path + ".warming", path + ".sock")  # found only once warm
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
            break
        except TimeoutError:
            if os.getppid() != launcher:  # the launcher is gone: nothing will launch here again
                return 0
    open(path + ".taken", "w").close()
    os.unlink(path + ".sock")
    listener.close()
    return _run(conn, started)


def _run(conn: socket.socket, started: dict[str, str]) -> int:
    """Take a rank or torchrun over from the process at the other end of `conn` (this process was `started` with
    that environment), run it, send its exit code."""
    import runpy
    import traceback

    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    body = json.loads(msg)
    changed = differs(started, body["env"])
    if changed:
        conn.send(json.dumps({"refused": f"its environment differs in {', '.join(changed[:3])}"}).encode())
        return 0
    _adopt(body, fds, started)
    conn.send(json.dumps({"pid": os.getpid()}).encode())
    threading.Thread(target=_die_with_rank, args=(conn,), daemon=True, name="standby-rank").start()
    sys.argv = [f"python -m {body['module']}", *body["argv"]]
    try:  # `python -m MODULE ARGS`, in this process: the command torchrun (or the launcher) would have run
        runpy.run_module(body["module"], run_name="__main__", alter_sys=False)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # as the interpreter ends a cold rank: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(json.dumps({"exit": code}).encode())
    return code


def _adopt(body: dict, fds: list[int], started: dict[str, str]) -> None:
    """Become the process that handed over: its standard streams, environment and working folder. A rank's has
    what the imports added, as a cold rank's, and when torchrun started it (lmyard.stages.startup.RANK_STARTED_ENV);
    torchrun's has only its own (the ranks it starts get no more than a cold torchrun's would) and
    AGENT_STARTED_ENV, that its ranks run under a warm torchrun."""
    from lmyard.stages.startup import AGENT_STARTED_ENV, RANK_STARTED_ENV

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    rank = body["module"] == RANK
    added = {k: v for k, v in os.environ.items() if k not in started and rank}
    mine = {RANK_STARTED_ENV if rank else AGENT_STARTED_ENV: str(body["started"])}
    os.environ.clear()
    os.environ.update({**added, **body["env"], **mine})
    os.chdir(body["cwd"])


def _die_with_rank(conn: socket.socket) -> None:
    """The process that handed over ended (killed: torchrun's SIGKILL, or the launcher's): so do this one and
    what it started (a torchrun's ranks, a rank's compile workers)."""
    import psutil

    while conn.recv(65536):
        pass
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from lmyard.stages.runtime import exit_fast

    if sys.argv[1:2] == ["--serve"]:
        exit_fast(lambda: serve(sys.argv[2]))
    if sys.argv[1:2] == ["--agent"]:
        exit_fast(lambda: take_over(AGENT, sys.argv[2:]))
    exit_fast(lambda: take_over(RANK, sys.argv[1:]))
