"""A Docker job whose engine stopped answering (`systemctl stop docker` on a node's host): what the launcher reads
of that node is nothing, never a connection error, and its log stream names the node as lost. The drill on two
hosts: tests/integration/test_hosts.py."""

from __future__ import annotations

import queue

import docker

from lmyard.launch.docker_job import DockerJob
from lmyard.recipes import load_recipe

SPEC = {"config": None, "shards": {"address": "a", "uri": "file:///s/shards/a", "manifest": {}}, "lineage": None}


def _job_on_a_stopped_engine(tmp_path) -> DockerJob:
    cfg = load_recipe("smoke", [f"store={tmp_path / 'store'}", "launch.backend=docker"])
    job = DockerJob(cfg, {**SPEC, "config": cfg.model_dump(mode="json")}, print, image="lmyard-stage:test")
    gone = docker.DockerClient(base_url=f"unix://{tmp_path}/docker.sock", version="1.41")  # its socket is gone
    job.containers = [gone.containers.prepare_model({"Id": "0123456789ab", "Name": "/node-0"})]
    return job


def test_the_files_of_a_node_whose_engine_stopped_read_as_absent(tmp_path):
    job = _job_on_a_stopped_engine(tmp_path)
    assert job.read("result.json") is None
    assert job.read_all("heartbeat") == {}


def test_the_log_stream_of_a_node_whose_engine_stopped_names_the_node_as_lost(tmp_path):
    job = _job_on_a_stopped_engine(tmp_path)
    events: queue.Queue = queue.Queue()
    job._pump(0, job.containers[0], events)
    kind, node, why = events.get_nowait()
    assert (kind, node) == ("error", 0) and why.startswith(f"its engine {job.plan.nodes[0].url} stopped answering")
