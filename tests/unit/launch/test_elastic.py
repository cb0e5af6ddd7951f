"""Elastic training's planning (lmyard.launch.elastic): which nodes a resized launch runs on and with what config,
which engines count as healthy, and a dead Ray node counted as one that may come back. The runs that lose and
regain a host are tests/integration/test_hosts.py (Docker) and tests/integration/test_hosts_ray.py (Ray)."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides

from lmyard.errors import UserError
from lmyard.launch.docker_job import plan
from lmyard.launch.elastic import DockerMembers, attempt_hosts
from lmyard.launch.ray_requests import fitting, unfit
from lmyard.recipes import load_recipe

A, B, C = "unix:///run/a.sock", "unix:///run/b.sock", "unix:///run/c.sock"


def _three(tmp_path, *sets: str):
    return load_recipe(
        "smoke",
        [
            *tiny_overrides(tmp_path),
            "launch.backend=docker",
            "launch.nnodes=3",
            "launch.nproc_per_node=1",
            f"launch.docker.nodes=[{A}, {B}, {C}]",
            "launch.docker.node_addrs=[10.0.0.1, 10.0.0.2, 10.0.0.3]",
            *sets,
        ],
    )


def test_min_nnodes_defaults_to_nnodes_and_may_not_exceed_it(tmp_path):
    assert _three(tmp_path).launch.fewest_nodes() == 3
    assert _three(tmp_path, "launch.min_nnodes=1").launch.fewest_nodes() == 1
    with pytest.raises(UserError, match=r"launch.min_nnodes=4 is above launch.nnodes=3"):
        _three(tmp_path, "launch.min_nnodes=4")


def test_a_global_batch_that_a_smaller_size_cannot_hold_is_refused_at_load_naming_that_size(tmp_path):
    sets = ("train.micro_batch=2", "model.block_size=64", "train.batch_tokens=384")  # 128 tokens a rank's micro-step
    assert _three(tmp_path, *sets, "launch.min_nnodes=3").train.batch_tokens == 384  # no smaller size: as before
    assert _three(tmp_path, "train.micro_batch=2", "model.block_size=64", "train.batch_tokens=768",
                  "launch.min_nnodes=1").launch.min_nnodes == 1  # fmt: skip  # 768 = 6 x 128: 1, 2 and 3 nodes
    with pytest.raises(UserError, match=r"batch_tokens \(384\) is not a multiple .* at 2 of launch.nnodes=3 \(256\)"):
        _three(tmp_path, *sets, "launch.min_nnodes=1")


def test_a_launch_without_a_lost_node_runs_on_the_others_engines_and_addresses_with_node_0_hosting(tmp_path):
    cfg = _three(tmp_path, "launch.min_nnodes=1")
    smaller = DockerMembers(cfg).config([0, 2])
    assert smaller.launch.nnodes == 2 and smaller.launch.min_nnodes is None
    assert smaller.launch.docker.nodes == [A, C] and smaller.launch.docker.node_addrs == ["10.0.0.1", "10.0.0.3"]
    spec = {"config": smaller.model_dump(mode="json"), "shards": {"address": "x", "uri": "x", "manifest": {}}}
    nodes = plan(smaller, spec, image="img").nodes
    assert [n.url for n in nodes] == [A, C]
    assert all("--rdzv_endpoint 10.0.0.1:29400" in " ".join(n.kwargs["command"]) for n in nodes)
    # host a lost: host c's node is node 0 and hosts the rendezvous at its own address
    alone = DockerMembers(cfg).config([2])
    (node,) = plan(alone, {**spec, "config": alone.model_dump(mode="json")}, image="img").nodes
    command = " ".join(node.kwargs["command"])
    assert node.url == C and "--standalone --local_addr 10.0.0.3" in command, command


def test_an_engine_that_does_not_answer_is_not_healthy(tmp_path):
    cfg = _three(tmp_path, "launch.min_nnodes=1", f"launch.docker.nodes=[unix://{tmp_path}/none.sock, {B}, {C}]")
    assert DockerMembers(cfg).healthy([0, 1, 2]) == []  # no engine listens at any of these sockets
    assert attempt_hosts(cfg) == ["node 0 (10.0.0.1)", "node 1 (10.0.0.2)", "node 2 (10.0.0.3)"]


def test_a_dead_ray_node_counts_as_one_that_may_come_back_not_as_one_too_small():
    alive = {"Alive": True, "Resources": {"CPU": 1.0}}
    dead = {"Alive": False, "Resources": {}}  # how ray.nodes() lists a lost node
    assert unfit({"CPU": 1.0}, 2, [alive, dead]) is None  # the job waits for it (placement_timeout_s)
    assert unfit({"CPU": 1.0}, 3, [alive, dead]) is not None  # never three, even if it comes back
    # none alive can hold it: the dead one is not taken to either (a GPU the cluster never had)
    assert unfit({"CPU": 2.0}, 2, [alive, dead]) == "0 of its 1 nodes have CPU >= 2 and launch.nnodes=2 needs 2"
    assert fitting({"CPU": 1.0}, [alive, dead, {"Alive": True, "Resources": {"CPU": 0.5}}]) == [alive]


def test_the_lineage_status_gives_each_attempt_its_nodes_hosts_why_it_resized_and_the_steps_it_trained():
    from flows.ops import _attempt_line
    from lmyard.tracking.runs import _attempts

    tags = {
        "lmyard.attempts": "3",
        **{f"lmyard.attempt.1.{k}": v for k, v in {"start_step": "0", "nodes": "2", "hosts": "a, b"}.items()},
        "lmyard.attempt.1.outcome": "resized: lost node 1 (b): its engine stopped answering",
        **{f"lmyard.attempt.2.{k}": v for k, v in {"start_step": "3", "nodes": "1", "hosts": "a"}.items()},
        "lmyard.attempt.2.resized": "lost node 1 (b): its engine stopped answering",
        "lmyard.attempt.2.outcome": "resized: grew back: node 1 (b) healthy again",
        **{f"lmyard.attempt.3.{k}": v for k, v in {"start_step": "7", "nodes": "2", "hosts": "a, b"}.items()},
        "lmyard.attempt.3.resized": "grew back: node 1 (b) healthy again",
    }
    one, two, three = _attempts(tags)
    assert [(a.nodes, a.steps) for a in (one, two, three)] == [(2, 3), (1, 4), (2, None)]  # the last one runs
    assert _attempt_line(two, True) == (
        "  attempt 2: from step 3, 1 nodes (a), 4 steps, resized: lost node 1 (b): its engine stopped answering, "
        "resized: grew back: node 1 (b) healthy again"
    )
    assert (
        _attempt_line(one, False) == "  attempt 1: from step 0, resized: lost node 1 (b): its engine stopped answering"
    )


def test_a_placement_that_timed_out_names_the_lost_nodes_addresses_and_what_to_do():
    from lmyard.launch.ray_requests import lost_nodes

    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.2"},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3"},
        {"Alive": False, "NodeManagerAddress": "10.0.0.2"},  # an old node of a host that is back
    ]
    said = lost_nodes(nodes)
    assert said.startswith("; lost nodes at 10.0.0.3: start Ray there again (`ray start --address=...`"), said
    assert lost_nodes(nodes[:1]) == ""
