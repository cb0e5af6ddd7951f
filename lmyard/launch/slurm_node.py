"""One node's task of a Slurm job (lmyard.launch.slurm): `python -m lmyard.launch.slurm_node FOLDER`, run by srun.

It reads the job folder's plan.json, fills in the rendezvous (the NodeAddr of the job's first node), this node's
address and the job id, and runs this node's command in a process group of its own, its output to
`node-<i>/output.log` and its exit code to `node-<i>/exit`; SIGTERM and SIGINT (scancel, Slurm's preemption or
time limit) go on to every process under it (the ranks checkpoint and exit as preempted)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def node_addr(name: str) -> str:
    """The address Slurm reaches node `name` at (its NodeAddr)."""
    for field in _scontrol("show", "node", "-o", name).split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return name


def filled(argv: list[str]) -> list[str]:
    """argv with {head} (the first node's address), {self} (this node's) and {job} (the job id) filled in."""
    if not any("{" in a for a in argv):
        return argv
    head = _scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()[0]
    me = os.environ.get("SLURMD_NODENAME") or _scontrol("show", "hostnames", os.environ["SLURM_NODELIST"]).split()[0]
    values = {"{head}": node_addr(head), "{self}": node_addr(me), "{job}": os.environ.get("SLURM_JOB_ID", "0")}
    out = []
    for a in argv:
        for key, value in values.items():
            a = a.replace(key, value)
        out.append(a)
    return out


def _forward(proc: subprocess.Popen):
    """A signal handler that passes the signal to the node's process group and every process under it."""

    def handler(sig: int, _frame) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)

    return handler


def main(folder: str) -> int:
    node = int(os.environ.get("SLURM_NODEID", "0"))
    mine = os.path.join(folder, f"node-{node}")
    os.makedirs(mine, exist_ok=True)
    with open(os.path.join(folder, "plan.json")) as f:
        plan = json.load(f)
    env = {**os.environ, **plan["env"], plan["exchange_env"]: mine}
    with open(os.path.join(mine, "output.log"), "ab", buffering=0) as out:
        try:
            argv = filled(plan["argv"][node])
        except (subprocess.SubprocessError, OSError, KeyError) as e:
            out.write(f"node {node}: cannot find the rendezvous through scontrol: {e}\n".encode())
            return _exit(mine, 1)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _forward(proc))
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:
                continue
    return _exit(mine, code)


def _exit(folder: str, code: int) -> int:
    """Record this node's exit code (written whole: the launcher reads it as the node's end)."""
    tmp = os.path.join(folder, "exit.tmp")
    with open(tmp, "w") as f:
        f.write(str(code))
    os.replace(tmp, os.path.join(folder, "exit"))
    return 0 if code == 0 else min(abs(code), 255)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
