"""The Slurm backend on a real Slurm (tests/slurm_cluster.py): slurmctld and munged in the services host, the login
node the launch runs in (tests/launch_on_host.py), and a slurmd in each of hosts a and b, each job's processes in
its host's namespace. The store is a folder and the tracking URI a sqlite file: the simulated hosts share this
machine's disk, as a cluster's nodes share a filesystem (docs/slurm.md).

Skipped where namespaces cannot be made or Slurm is not installed; LMYARD_REQUIRE_HOSTS=1 fails instead.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides
from hosts import Hosts, require_hosts
from slurm_cluster import PARTITION, SlurmCluster, missing_programs

from lmyard.recipes import load_recipe

pytestmark = pytest.mark.slow
LAUNCHER = str(REPO / "tests" / "launch_on_host.py")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A two-node Slurm cluster for this module; its teardown checks that nothing of it is left: no daemon, job,
    namespace or file."""
    require_hosts()
    if missing := missing_programs():
        pytest.skip(f"Slurm is not installed here: no {', '.join(missing)} (slurmctld slurmd munge slurm-client)")
    harness = Hosts(tmp_path_factory.mktemp("slurm-hosts"), ["a", "b"])
    with harness, SlurmCluster(harness) as cluster:
        yield cluster
        assert cluster.idle() == []
    assert harness.leftovers() == []


def _sets(tmp: Path, **extra) -> list[str]:
    return tiny_overrides(
        tmp,
        **{
            "launch.backend": "slurm",
            "launch.nnodes": 2,
            "launch.nproc_per_node": 1,
            "launch.slurm.partition": PARTITION,
            "launch.slurm.socket_ifname": "eth0",  # each host's only interface
            **extra,
        },
    )


def _start(
    slurm: SlurmCluster, tmp: Path, out: Path, env: dict[str, str] | None = None, *flags: str, **sets
) -> subprocess.Popen:
    """tests/launch_on_host.py in the services host (the login node): shard, open the lineage, launch on Slurm."""
    svc = slurm.hosts.services
    cmd = svc.argv([sys.executable, LAUNCHER, str(out), *flags, *(f"--set={s}" for s in _sets(tmp, **sets))])
    return subprocess.Popen(cmd, env=svc.env(slurm.env(env)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _launch(slurm: SlurmCluster, tmp: Path, env: dict[str, str] | None = None, *flags: str, **sets) -> dict:
    out = tmp / f"launch-{time.monotonic_ns()}.json"
    proc = _start(slurm, tmp, out, env, *flags, **sets)
    output, _ = proc.communicate(timeout=900)
    return json.loads(out.read_text()) if out.exists() else {"lines": [output.decode()], "error": "no output"}


def test_two_slurm_nodes_train_one_rank_each_to_the_val_loss_of_two_local_ranks_then_evaluate_on_a_job_of_its_own(
    slurm, tmp_path
):
    """One Slurm job of two nodes, torchrun on each with the rendezvous at the first node: a rank in each host's
    namespace, and the validation loss of the same config on two local ranks within a relative 1e-6 (as across
    Docker engines and Ray nodes, tests/integration/test_hosts.py, tests/integration/test_hosts_ray.py). The evaluate stage is a Slurm job
    of its own, scoring the last checkpoint at the trainer's val loss. No job is left in squeue."""
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.launch.local_job import run_local
    from lmyard.stages import TrainSpec

    t0 = time.perf_counter()
    launched = _launch(slurm, tmp_path, None, "--evaluate", run_name="slurm-hosts")
    print(f"two Slurm nodes: {time.perf_counter() - t0:.0f} s")
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    result = launched["result"]
    assert result["status"] == "done" and result["step"] == 6, text[-3000:]
    joined = sorted(
        re.sub(r" \[rank \d+\]", "", line.split(": ranks")[0]) for line in launched["lines"] if "of 2 joined" in line
    )
    assert joined == ["[node 0] host-a", "[node 1] host-b"], text[-3000:]
    evaluation, eval_text = launched["evaluation"], "\n".join(launched["eval_lines"])
    assert evaluation["step"] == 6 and any(line.startswith("Slurm job ") for line in launched["eval_lines"]), eval_text
    assert evaluation["val_loss"] == pytest.approx(evaluation["trainer_val_loss"], rel=1e-6)
    assert slurm.jobs() == []

    local = load_recipe(
        "smoke", tiny_overrides(tmp_path / "local", run_name="slurm-hosts", **{"launch.nproc_per_node": 2})
    )
    shards, _ = tokenize_and_shard(local, log=lambda s: None)
    here = run_local(local, TrainSpec(config=local, shards=shards), on_line=lambda s: None)
    assert result["val_loss"] == pytest.approx(here.val_loss, rel=1e-6), (result["val_loss"], here.val_loss)


def _wait_for_step(slurm: SlurmCluster, step: int, proc: subprocess.Popen, timeout_s: float = 600) -> str:
    """The id of the one running job once both nodes' ranks have reported `step` (their heartbeats)."""
    cache = slurm.hosts.services.cache
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        beats = [p.read_text().strip() for p in cache.glob("lmyard-train-*/node-*/heartbeat/rank-*")]
        running = [line.split()[0] for line in slurm.jobs() if line.endswith("RUNNING")]
        if len(beats) == 2 and all(b.isdigit() and int(b) >= step for b in beats) and len(running) == 1:
            return running[0]
        time.sleep(0.5)
    raise AssertionError(f"the job did not reach step {step}: {slurm.jobs()}")


def test_scancel_term_commits_the_step_and_the_retried_attempt_resumes_it_in_the_same_lineage(slurm, tmp_path):
    """`scancel --signal=TERM` (what Slurm's preemption and time limit send, through sbatch --signal) while both
    ranks pause after step 2: the step is committed, the launch ends preempted (exit 5, not a crash), no job is
    left, and the next attempt resumes at step 2 on the same MLflow run."""
    out = tmp_path / "first.json"
    faults = {"LMYARD_FAULTS": "pause@2", "LMYARD_FAULT_PAUSE_S": "20"}
    proc = _start(slurm, tmp_path, out, faults, run_name="slurm-preempt")
    try:
        job = _wait_for_step(slurm, 2, proc)
        assert slurm.run(["scancel", "--signal=TERM", job]).returncode == 0
        proc.communicate(timeout=600)
    finally:
        proc.kill()
    first = json.loads(out.read_text())
    text = "\n".join(first["lines"])
    assert first.get("error_type") == "Preempted" and first["exit_code"] == 5, f"{first.get('error')}\n{text[-3000:]}"
    assert slurm.jobs() == []

    second = _launch(slurm, tmp_path, run_name="slurm-preempt")
    text = "\n".join(second["lines"])
    assert "result" in second, f"{second.get('error')}\n{text[-3000:]}"
    assert second["result"]["start_step"] == 2 and second["result"]["step"] == 6, text[-3000:]
    assert second["result"]["resumed_from"].rstrip("/").endswith("step_00000002")
    assert second["mlflow_run_id"] == first["mlflow_run_id"]


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ({"launch.slurm.partition": "nope"}, "Invalid partition name specified"),
        ({"launch.nnodes": 3}, f"in partition {PARTITION}: Partition"),  # PartitionConfig or PartitionNodeLimit
    ],
    ids=["no-such-partition", "more-nodes-than-the-cluster"],
)
def test_a_job_slurm_can_never_run_is_one_line_exit_2_before_training_and_leaves_no_job(slurm, tmp_path, sets, named):
    launched = _launch(slurm, tmp_path, run_name="slurm-never", **sets)
    text = "\n".join(launched["lines"])
    assert launched.get("error_type") == "UserError" and launched["exit_code"] == 2, text[-3000:]
    assert named in launched["error"] and "\n" not in launched["error"], launched["error"]
    assert not [line for line in launched["lines"] if "joined" in line or "step 1" in line], text[-3000:]
    assert slurm.jobs() == []


def test_a_job_pending_past_its_timeout_is_cancelled_in_one_line_naming_the_partition_and_squeues_reason(
    slurm, tmp_path
):
    """Both nodes are taken by another job: the launch's job pends for Resources, and after
    launch.slurm.pending_timeout_s it is cancelled, in one line; only the other job is left."""
    blocker = slurm.run(["sbatch", "--parsable", "-N", "2", "--exclusive", f"--output={tmp_path / 'blocker.out'}",
                         "--wrap", "sleep 600"])  # fmt: skip  # its log in the test's folder, not the cwd
    assert blocker.returncode == 0, blocker.stderr
    other = blocker.stdout.strip()
    try:
        launched = _launch(slurm, tmp_path, None, **{"run_name": "slurm-pending", "launch.slurm.pending_timeout_s": 5})
        assert slurm.jobs() in ([f"{other} RUNNING"], [f"{other} PENDING"])
    finally:
        slurm.run(["scancel", other])
        assert slurm.idle() == []
    text = "\n".join(launched["lines"])
    assert launched.get("error_type") == "UserError" and launched["exit_code"] == 2, text[-3000:]
    message = launched["error"]
    assert f"in partition {PARTITION}: " in message and "(squeue)" in message and "\n" not in message, message
    assert "pending_timeout_s" in message, message
