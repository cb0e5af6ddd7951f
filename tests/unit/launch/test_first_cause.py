"""Which rank of a failed training failed first (lmyard.launch.cause): from torchrun's files and the ranks' own
records, as the launcher reads them back from a job's exchange folders."""

from __future__ import annotations

import json

from lmyard.errors import StoreOutage, TrainingFailed
from lmyard.launch.cause import first_cause, rank_ends
from lmyard.stages import StageError, read_result
from lmyard.stages.runtime import OUTPUT_LINES

GLOO = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"


def _record(rank: int, at: float, message: str = GLOO, code: int = 1, output=()) -> StageError:
    raw = json.dumps(
        {"status": "crashed" if code == 1 else "store_outage", "exit_code": code, "message": message}
        | {"rank": rank, "at": at, "output": list(output)}
    )
    record = read_result(raw, StageError)  # as the launcher reads a rank's file back
    assert isinstance(record, StageError)
    return record


def _files(**by_node: dict) -> dict[str, bytes]:
    return {node: json.dumps(v).encode() for node, v in by_node.items()}


def test_a_rank_that_died_without_a_word_is_first_over_one_that_raised_on_its_absence_within_the_second():
    """Two nodes: rank 1 exited without a record (torchrun's whole-second time), rank 0 raised gloo's error a
    fraction of a second after it: rank 1 is first, rank 0 follows, whichever node's file comes first."""
    exits = _files(n0={"0": 1}, n1={"1": 1})
    times = _files(n0={"0": 1000.0}, n1={"1": 1000.0})
    ends = rank_ends(exits, times, [_record(0, at=1000.4)])
    cause = first_cause(ends, {1: ["step 5/12", "injected crash of rank 1 after step 5"]})
    assert cause.first.rank == 1 and cause.followers == [0]
    line = cause.error("train")
    assert isinstance(line, TrainingFailed) and "\n" not in str(line)
    assert str(line) == (
        "train: rank 1 exited with code 1 first: injected crash of rank 1 after step 5; rank 0 failed after it"
    )
    assert line.output == ["step 5/12", "injected crash of rank 1 after step 5"]


def test_records_times_order_ranks_that_both_raised_and_a_signal_goes_before_both():
    exits = _files(n0={"0": 1, "1": 1})
    ends = rank_ends(exits, {}, [_record(0, at=2000.9), _record(1, at=2000.2, message="ValueError: bad batch")])
    cause = first_cause(ends, {})
    assert cause.first.rank == 1 and str(cause.error("train")).startswith("train: rank 1 exited with code 1 first:")
    killed = rank_ends(_files(n0={"0": 1, "1": -9}), _files(n0={"0": 1.0, "1": 9.0}), [_record(0, at=1.0)])
    first = str(first_cause(killed, {}).error("train"))
    assert first.startswith("train: rank 1 was killed by signal 9 (SIGKILL"), first
    assert first.endswith("rank 0 failed after it")


def test_ranks_torchrun_stopped_follow_the_ranks_it_saw_fail():
    """One node: torchrun saw rank 1 end and stopped rank 0, whose record (a gloo error) is older than torchrun's
    whole-second time of rank 1: rank 0 is not a candidate."""
    ends = rank_ends(_files(n0={"1": 1}), _files(n0={"1": 3001.0}), [_record(0, at=3000.2)])
    assert first_cause(ends, {}).first.rank == 1


def test_a_traceback_kept_in_the_record_is_the_output_at_most_ten_lines_and_is_not_on_the_log_yet():
    trace = [f"  frame {i}" for i in range(30)] + ["ValueError: bad batch"]
    ends = rank_ends(_files(n0={"1": 1}), {}, [_record(1, at=5.0, message="ValueError: bad batch", output=trace)])
    cause = first_cause(ends, {1: ["something it printed"]})
    assert not cause.printed and cause.output == trace[-OUTPUT_LINES:]


def test_the_first_ranks_own_error_decides_the_exception():
    ends = rank_ends(_files(n0={"0": 4}), {}, [_record(0, at=1.0, message="store unreachable", code=4)])
    error = first_cause(ends, {}).error("train")
    assert isinstance(error, StoreOutage) and str(error) == "train: rank 0 exited with code 4: store unreachable"


def test_a_rank_torchrun_sigtermed_is_never_first_while_another_ended_by_itself_even_at_an_earlier_time():
    """On a loaded machine torchrun's whole-second time of the rank it stopped (SIGTERM, -15) can read earlier than
    the crashed rank's own: the crashed rank is still the cause, in the launcher and in the node's own line."""
    from lmyard.launch.torchrun import first_to_fail

    ends = rank_ends(_files(n0={"0": -15, "1": 1}), _files(n0={"0": 4000.0, "1": 4001.0}), [])
    assert first_cause(ends, {}).first.rank == 1
    assert first_to_fail({0: -15, 1: 1}, {0: 4000.0, 1: 4001.0}) == 1
    assert first_to_fail({0: -15, 1: -15}, {0: 4001.0, 1: 4000.0}) == 1  # all stopped: the earliest
    assert first_to_fail({0: -15, 1: 1, 2: -9}, {0: 1.0, 1: 1.0, 2: 9.0}) == 2  # a kill -9 goes before both


def test_ranks_sharing_the_unbuffered_output_never_cut_into_each_others_lines():
    """Two ranks print at once into one pipe, unbuffered as the launcher starts them: every line read back is one
    rank's whole line (the launcher finds the rank that failed first by those lines)."""
    import subprocess
    import sys

    code = (
        "import sys; from lmyard.stages.runtime import prefix_rank_lines; r = int(sys.argv[1]); prefix_rank_lines(r)\n"
        "for i in range(3000): print(f'step {i} of rank {r} | loss 5.0', flush=i % 7 == 0)\n"
    )
    read, write = __import__("os").pipe()
    ranks = [
        subprocess.Popen([sys.executable, "-u", "-c", code, str(r)], stdout=write, stderr=write, pass_fds=(write,))
        for r in (0, 1)
    ]
    __import__("os").close(write)
    with open(read) as out:
        lines = out.read().splitlines()
    assert [p.wait(timeout=60) for p in ranks] == [0, 0]
    expected = {f"step {i} of rank 0 | loss 5.0" for i in range(3000)}
    expected |= {f"[rank 1] step {i} of rank 1 | loss 5.0" for i in range(3000)}
    assert set(lines) == expected and len(lines) == len(expected), sorted(set(lines) - expected)[:5]


def test_a_rank_that_prints_in_its_signal_handler_while_printing_goes_on():
    """The trainer says `SIGTERM received` from its handler, which runs inside whatever print the main thread
    was in: the rank's line writer must not wait on itself (a rank hung there until torchrun killed it)."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    code = (
        "import signal, sys, time; from lmyard.stages.runtime import prefix_rank_lines; prefix_rank_lines(0)\n"
        "done = []\n"
        "def said(*_): print('SIGTERM received; checkpointing after this step', flush=True); done.append(1)\n"
        "signal.signal(signal.SIGTERM, said)\n"
        "print('ready', flush=True)\n"
        "while len(done) < 10: print('step ' * 200, flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('stopped', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()  # drained as it goes: a full pipe would hold the prints, not the lock
    try:
        for _ in range(500):  # again and again, so some land inside a write
            if proc.poll() is not None:
                break
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.02)
        proc.wait(timeout=60)
    finally:
        proc.kill()  # a rank that hung: not left behind
    reader.join(60)
    out = read[0] if read else ""
    assert proc.returncode == 0 and "SIGTERM received" in out and out.endswith("stopped\n"), (
        proc.returncode,
        out[-300:],
    )
