"""The Ray backend across simulated hosts (tests/hosts.py): `ray start --head` in host a, `ray start --address` in
host b, each at its host's address with one CPU; the launch runs beside host a's Ray node, as a driver there.

The store is a folder and the tracking URI a sqlite file by absolute path: the simulated hosts share this
machine's disk (real hosts need S3 and an MLflow server, docs/multi-host.md). Host b's LMYARD_CACHE is a small
filesystem of its own (tmpfs), mounted before its Ray node starts, so that a test can fill it.

Skipped where namespaces cannot be made (not root, no `ip`); LMYARD_REQUIRE_HOSTS=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, nothing_tracked_in, tiny_overrides
from hosts import RAY, RAY_PORT, Hosts, require_hosts

from lmyard.recipes import load_recipe
from lmyard.run import Run

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
B_CACHE_SIZE = "64m"


def _require() -> None:
    require_hosts()
    if not os.path.exists(RAY):
        pytest.skip("Ray's `ray` command is not installed")


def _wait_for_nodes(host, count: int, timeout_s: float = 180) -> None:
    """From beside `host`'s Ray node: until the cluster has `count` live nodes."""
    poll = (
        "import sys, time, ray\n"
        f"ray.init(address='{host.addr}:{RAY_PORT}', log_to_driver=False)\n"
        f"deadline = time.monotonic() + {timeout_s}\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
        "    if time.monotonic() > deadline: sys.exit(1)\n"
        "    time.sleep(0.5)\n"
    )
    done = subprocess.run(host.in_ray([sys.executable, "-c", poll]), env=host.env(), timeout=timeout_s + 60)
    assert done.returncode == 0, f"the Ray cluster did not reach {count} nodes (see the ray.log files)"


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory):
    """Hosts a (the Ray head) and b (a Ray node joining it), b's cache a small disk; for this module. Its
    teardown runs `ray stop` in each host and checks that nothing of it is left, no Ray process included."""
    _require()
    harness = Hosts(tmp_path_factory.mktemp("ray-hosts"), ["a", "b"])
    with harness:
        a, b = harness["a"], harness["b"]
        mount = ["mount", "-t", "tmpfs", "-o", f"size={B_CACHE_SIZE}", "lmyard-b-cache", str(b.cache)]
        if subprocess.run(mount, capture_output=True).returncode != 0:
            pytest.skip("host b's small cache disk needs `mount -t tmpfs` (root)")
        try:
            a.start_ray()
            b.start_ray(head=a)
            _wait_for_nodes(a, 2)
            yield harness
            for host in (b, a):  # `ray stop` in each host; the teardown's check below finds any Ray process left
                host.stop_ray()
        finally:
            subprocess.run(["umount", "-l", str(b.cache)], check=False)
    assert harness.leftovers() == []


def _launch(hosts: Hosts, tmp: Path, **sets) -> dict:
    """The tiny run on both Ray nodes, launched beside host a's node (tests/launch_on_host.py); its output."""
    out = tmp / "launch.json"
    ran = subprocess.run(_command(hosts, tmp, out, **sets), env=hosts["a"].env(), capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    return json.loads(out.read_text()) if out.exists() else {"lines": [ran.stdout, ran.stderr], "error": "no output"}


def _command(hosts: Hosts, tmp: Path, out: Path, **sets) -> list[str]:
    """tests/launch_on_host.py beside host a's Ray node, writing `out`."""
    a = hosts["a"]
    overrides = tiny_overrides(
        tmp,
        **{
            "launch.backend": "ray",
            "launch.nnodes": 2,
            "launch.nproc_per_node": 1,
            "launch.ray.address": f"{a.addr}:{RAY_PORT}",
            "launch.ray.runtime_env": "{env_vars: {GLOO_SOCKET_IFNAME: eth0}}",  # each host's only interface
            **sets,
        },
    )
    launcher = str(REPO / "tests" / "launch_on_host.py")
    return a.in_ray([sys.executable, launcher, str(out), *(f"--set={s}" for s in overrides)])


def _ray_processes(hosts: Hosts) -> list[str]:
    return [f"{comm} in {ns}" for _, comm, ns in hosts._processes_in_namespaces() if comm in ("raylet", "gcs_server")]


def test_two_ray_nodes_on_two_hosts_train_one_rank_each_to_the_val_loss_of_two_local_ranks(ray_hosts, tmp_path):
    """The placement group puts one actor on each host (STRICT_SPREAD); each runs torchrun at its node's address,
    the rendezvous at host a's. The same config on two local ranks ends at the same validation loss within a
    relative 1e-6, as across Docker engines (tests/integration/test_hosts.py)."""
    from lmyard.data.sharding import tokenize_and_shard
    from lmyard.launch.local_job import run_local
    from lmyard.stages import TrainSpec

    a, b = ray_hosts["a"], ray_hosts["b"]
    assert sorted(_ray_processes(ray_hosts)) == [
        f"gcs_server in {a.netns}",
        f"raylet in {a.netns}",
        f"raylet in {b.netns}",
    ]
    t0 = time.perf_counter()
    launched = _launch(ray_hosts, tmp_path, run_name="ray-hosts")
    print(f"two Ray nodes: {time.perf_counter() - t0:.0f} s")
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    result = launched["result"]
    assert result["status"] == "done" and result["step"] == 6, text[-3000:]

    # one actor on each host, at its host's address (the placement group picks which node is node 0)
    placed = [re.match(r"node (\d): train on Ray node \w+ at ([\d.]+) ", line) for line in launched["lines"]]
    addrs = {int(m.group(1)): m.group(2) for m in placed if m}
    assert sorted(addrs) == [0, 1] and sorted(addrs.values()) == [a.addr, b.addr], text[-3000:]
    host_of = {a.addr: a.hostname, b.addr: b.hostname}
    joined = sorted(
        re.sub(r" \[rank \d+\]", "", line.split(": ranks")[0]) for line in launched["lines"] if "of 2 joined" in line
    )
    assert joined == [f"[node {i}] {host_of[addrs[i]]}" for i in (0, 1)], text[-3000:]

    local = load_recipe(
        "smoke", tiny_overrides(tmp_path / "local", run_name="ray-hosts", **{"launch.nproc_per_node": 2})
    )
    shards, _ = tokenize_and_shard(local, log=lambda s: None)
    here = run_local(local, TrainSpec(config=local, shards=shards), on_line=lambda s: None)
    assert here.step == 6 and here.val_loss is not None
    assert result["val_loss"] == pytest.approx(here.val_loss, rel=1e-6), (result["val_loss"], here.val_loss)
    assert result["train_loss"] == pytest.approx(here.train_loss, rel=1e-6), (result["train_loss"], here.train_loss)


def test_a_full_cache_disk_on_host_b_ends_the_launch_with_exit_4_in_one_line_naming_host_bs_folder(ray_hosts, tmp_path):
    """Host b's LMYARD_CACHE (its own small filesystem) is full when the job starts there: not retried (a retry
    would meet the same disk), no checkpoint lost (there is none yet), no Ray actor left."""
    from test_full_disk import fill

    a, b = ray_hosts["a"], ray_hosts["b"]
    fill(b.cache, leave=0)
    try:
        t0 = time.perf_counter()
        launched = _launch(ray_hosts, tmp_path, run_name="b-full")
        print(f"host b's full cache: {time.perf_counter() - t0:.0f} s")
    finally:
        (b.cache / "filler").unlink()
    text = "\n".join(launched["lines"])
    assert "result" not in launched, text[-3000:]
    message = launched["error"]
    assert launched["error_type"] == "NoSpace" and launched["exit_code"] == 4, f"{message}\n{text[-3000:]}"
    assert "\n" not in message and f"no space left in {b.cache}" in message, message
    assert re.search(rf"^node [01] \({b.hostname}, {re.escape(b.addr)}\): ", message), message  # the node, its host
    assert not [p for p in a.cache.iterdir() if p.name.startswith("lmyard-train-")]  # the driver's job folders
    assert sorted(_ray_processes(ray_hosts)) == [
        f"gcs_server in {a.netns}",
        f"raylet in {a.netns}",
        f"raylet in {b.netns}",
    ]


@pytest.mark.parametrize(
    "api_url, says",
    [
        (None, "PREFECT_API_URL is unset (lmyard's temporary server on 127.0.0.1): the sweep's trials on the Ray"),
        ("http://127.0.0.1:4200/api", "PREFECT_API_URL http://127.0.0.1:4200/api: the sweep's trials on the Ray"),
        ("http://{services}:4200/api", "trial sw-x1: the Ray cluster can never place its training: 0 of its 2"),
    ],
    ids=["temporary-server", "loopback", "placement"],
)
def test_a_ray_sweep_its_trials_cannot_run_is_refused_in_one_line_before_anything_is_made(
    ray_hosts, tmp_path, api_url, says
):
    """Trials on host b cannot reach a Prefect API on host a's loopback; 64 CPUs a node are on no node. The
    sweep launched beside host a says so in one line, exit 2, before a Prefect server, a shard or a run exists."""
    a, b = ray_hosts["a"], ray_hosts["b"]
    sets = {"run_name": "sw", "launch.backend": "ray", "launch.ray.address": f"{a.addr}:{RAY_PORT}"}
    if api_url and "{services}" in api_url:  # reachable from every host; the refusal is the placement's
        sets["launch.ray.cpus_per_node"] = 64
    overrides = tiny_overrides(tmp_path, **sets)
    env = {k: v for k, v in a.env().items() if k != "PREFECT_API_URL"}
    if api_url:
        env["PREFECT_API_URL"] = api_url.format(services=ray_hosts.services.addr)
    cmd = a.in_ray(
        [sys.executable, "-m", "flows.cli", "sweep", "smoke", "--sizes", "1", *(f"--set={s}" for s in overrides)]
    )
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmyard: error: {says}"), lines
    assert (b.addr in lines[0]) == says.startswith("PREFECT_API_URL") and proc.stdout == ""
    assert not (tmp_path / "store").exists() and nothing_tracked_in(tmp_path / "mlflow.db")  # no shard, no MLflow run


def test_a_killed_raylet_on_host_b_goes_on_on_host_a_and_grows_back_when_a_node_joins(ray_hosts, tmp_path):
    """launch.min_nnodes=1 on two Ray nodes. Host b's raylet is killed once step 3 is committed (every rank pauses
    after step 4): the attempt ends naming host b's address, and training goes on at once on host a's node alone
    from step 3. Once step 6 is committed there, a Ray node starts again in host b and joins: the run commits the
    step it is at, stops and relaunches on both nodes from it (every rank pauses after step 8, a window for the
    join), and finishes, with no committed step lost or trained twice."""
    import signal

    from mlflow.tracking import MlflowClient

    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.store import open_store
    from lmyard.tracking.runs import _attempts

    a, b = ray_hosts["a"], ray_hosts["b"]
    out = tmp_path / "launch.json"
    cmd = _command(ray_hosts, tmp_path, out, run_name="ray-elastic", **{"train.max_steps": 12, "eval.interval": 6},
                   **{"launch.min_nnodes": 1, "launch.grace_s": 10})  # fmt: skip
    faults = {"LMYARD_FAULTS": "pause@4,pause@8", "LMYARD_FAULT_PAUSE_S": "30"}
    launcher = subprocess.Popen(cmd, env=a.env(faults), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = open_store(str(tmp_path / "store"))

    def wait_for_step(step: int) -> None:
        deadline = time.monotonic() + 600
        while step not in complete_steps(Run("ray-elastic", store)):
            assert launcher.poll() is None and time.monotonic() < deadline, f"step {step} was never committed"
            time.sleep(0.5)

    try:
        wait_for_step(3)
        (raylet,) = [pid for pid, comm, ns in ray_hosts._processes_in_namespaces() if (comm, ns) == ("raylet", b.netns)]
        os.kill(raylet, signal.SIGKILL)  # its node is dead for good: Ray does not take a raylet back
        wait_for_step(6)  # committed on host a's node alone
        b.stop_ray()
        b.start_ray(head=a)  # a new node joins, at host b's address
        launcher.wait(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    launched = json.loads(out.read_text())
    text = "\n".join(launched["lines"])
    assert "result" in launched, f"{launched.get('error')}\n{text[-4000:]}"
    assert launched["result"]["status"] == "done" and launched["result"]["step"] == 12, text[-3000:]

    one, two, three = _attempts(
        MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(launched["mlflow_run_id"]).data.tags
    )
    assert (one.nodes, one.start_step, one.steps) == (2, 0, 3), one
    # each attempt names the hosts Ray placed its nodes on, not the nodes' numbers
    assert sorted(one.hosts.split(", ")) == sorted([f"{a.hostname} ({a.addr})", f"{b.hostname} ({b.addr})"]), one
    assert two.hosts == f"{a.hostname} ({a.addr})", two
    assert one.outcome and one.outcome.startswith("resized: lost") and f"({b.hostname}, {b.addr})" in one.outcome
    assert (two.nodes, two.start_step) == (1, 3) and two.outcome and two.outcome.startswith("resized: grew back")
    grew_at = two.start_step + two.steps
    assert (three.nodes, three.start_step, three.outcome) == (2, grew_at, "finished: step 12"), three
    committed = complete_steps(Run("ray-elastic", store))
    assert grew_at >= 6 and grew_at in committed and committed[-1] == 12, committed
    assert sorted(_ray_processes(ray_hosts)) == [
        f"gcs_server in {a.netns}",
        f"raylet in {a.netns}",
        f"raylet in {b.netns}",
    ]


def test_host_bs_link_cut_on_ray_is_named_and_its_retry_waits_for_the_node_then_resumes_from_the_last_step(
    ray_hosts, tmp_path
):
    """launch.min_nnodes = launch.nnodes (the default): no run below full size. Host b's link is cut once step 3 is
    committed (every rank pauses after step 4): the attempt ends in one line naming host b's address. A retry while
    host b has no Ray node waits for it up to launch.ray.placement_timeout_s and then fails in one line naming the
    lost node's address and what to do. Once the link is back and host b's Ray node is restarted (Ray never takes
    back a raylet whose heartbeats timed out: docs/multi-host.md), the next retry resumes from step 3 and finishes."""
    from lmyard.checkpoint.catalog import complete_steps
    from lmyard.store import open_store

    a, b = ray_hosts["a"], ray_hosts["b"]
    sets = {"run_name": "ray-cut", "train.max_steps": 6, "eval.interval": 3, "launch.grace_s": 10}
    out = tmp_path / "launch.json"
    faults = {"LMYARD_FAULTS": "pause@4", "LMYARD_FAULT_PAUSE_S": "30"}
    launcher = subprocess.Popen(_command(ray_hosts, tmp_path, out, **sets), env=a.env(faults),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    store = open_store(str(tmp_path / "store"))
    try:
        deadline = time.monotonic() + 600
        while 3 not in complete_steps(Run("ray-cut", store)):
            assert launcher.poll() is None and time.monotonic() < deadline, "step 3 was never committed"
            time.sleep(0.5)
        ray_hosts.set_link(b, up=False)
        launcher.wait(timeout=600)
        first = json.loads(out.read_text())
        # the retry, with host b still cut off: it waits for a second node, then gives up in one line
        waited = _launch(ray_hosts, tmp_path, **sets, **{"launch.ray.placement_timeout_s": 20})
    finally:
        ray_hosts.set_link(b, up=True)
        if launcher.poll() is None:
            launcher.kill()
    assert "result" not in first and "\n" not in first["error"], first.get("error")
    assert re.match(rf"lost node \d: its Ray actor \(\S+, {re.escape(b.addr)}\) is gone", first["error"]), first
    said = waited.get("error") or ""
    assert "result" not in waited and said.startswith("Ray: no room for 2 x") and "\n" not in said, said
    assert "placement_timeout_s=20" in said and f"lost nodes at {b.addr}: start Ray there again" in said, said
    assert complete_steps(Run("ray-cut", store))[-1] == 3

    b.stop_ray()  # what the docs tell an operator: restart the node
    b.start_ray(head=a)
    _wait_for_nodes(a, 2)
    resumed = _launch(ray_hosts, tmp_path, **sets)
    text = "\n".join(resumed["lines"])
    assert "result" in resumed, f"{resumed.get('error')}\n{text[-4000:]}"
    assert (resumed["result"]["start_step"], resumed["result"]["step"]) == (3, 6), text[-3000:]
    assert complete_steps(Run("ray-cut", store))[-1] == 6
