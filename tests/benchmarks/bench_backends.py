"""The Docker and Ray backends against the local backend on the same GPUs, through lmyard's one launcher.

    python tests/benchmarks/bench_backends.py --engine unix:///tmp/d.sock --image hostroot \
        --nodes 2 --node-gpus 0,1 2,3 --preset llama-1b --parallel fsdp --seq 2048 --batch 4 \
        --volume /usr/local:/usr/local:ro --volume /opt:/opt:ro --env PATH=/opt/torch/.venv/bin:/usr/bin:/bin
    python tests/benchmarks/bench_backends.py ... --drill sigterm    # SIGTERM to one container, then the retry
    python tests/benchmarks/bench_backends.py ... --drill kill       # `docker kill` of one container, then the retry
    python tests/benchmarks/bench_backends.py --device cpu --image lmyard-stage:TAG --preset tiny --seq 64 \
        --batch 2 --steps 20 --volume $(python -c "import site; print(site.getsitepackages()[0])"):/venv:ro \
        --env PYTHONPATH=$PWD:/venv                                 # a check of the script on CPU
    python tests/benchmarks/bench_backends.py --backends local ray --nodes 2 --node-gpus 0 1 \
        --preset llama-1b --parallel fsdp --seq 2048 --batch 4     # Ray: a local cluster of 2 nodes, 1 GPU each

For each backend it runs the same config through lmyard.launch.launcher.launch: `local` is one node of
nodes x GPUs ranks (torchrun here), `docker` is `--nodes` containers of the stage image (or any image with
torch, lmyard on PYTHONPATH) on one engine, GPUs given as device nodes (launch.docker.gpu_mode=devices,
launch.docker.node_gpus), c10d rendezvous across them; `ray` is `--nodes` Ray nodes (`--ray-address`, or a
local cluster that this script starts with ray.cluster_utils.Cluster: one raylet per node, each seeing only
its `--node-gpus` through CUDA_VISIBLE_DEVICES, so Ray hands each node actor its own GPUs), one bundle of
`launch.ray.gpus_per_node` GPUs per node in a STRICT_SPREAD placement group. Data: uniformly random GPT-2 token ids in a local
store (random_shards.py), read through the trainer's real data path. Prints one JSON line per run: tokens/s
(median of the log intervals after the first two), the loss at every log step, and the ratio docker/local.

A drill starts a docker run, acts on one container once the trainer has logged `--drill-step` steps, and
runs the same config again as the train task's retry would: it prints how the first attempt ended, that
no container of it is left, and the step the retry resumed from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from random_shards import make_shards  # noqa: E402

from lmyard.data.shardset import ShardSet  # noqa: E402
from lmyard.errors import StageFailed, UserError  # noqa: E402
from lmyard.launch.docker_job import LABEL  # noqa: E402
from lmyard.launch.launcher import launch  # noqa: E402
from lmyard.recipes import load_recipe  # noqa: E402
from lmyard.stages import TrainSpec  # noqa: E402

STEP = re.compile(r"step (\d+)/\d+ \| loss ([\d.]+) .*\| ([\d,]+) tok/s")


def config(a: argparse.Namespace, store: Path, backend: str, run_name: str):
    ranks = len(a.node_gpus[0].split(",")) if a.device == "cuda" else a.ranks
    sets = [
        f"store={store}",
        f"run_name={run_name}",
        f"model.preset={a.preset}",
        f"model.block_size={a.seq}",
        f"train.parallel={a.parallel}",
        f"train.max_steps={a.steps}",
        f"train.micro_batch={a.batch}",
        f"train.batch_tokens={a.batch * a.seq * ranks * a.nodes}",
        f"train.log_interval={a.log_interval}",
        f"train.device={a.device}",
        "eval.interval=100000",
        f"checkpoint.interval={a.checkpoint_interval}",
        f"launch.backend={backend}",
    ]
    if backend == "local":
        sets += ["launch.nnodes=1", f"launch.nproc_per_node={ranks * a.nodes}"]
    elif backend == "ray":
        gpus = ranks if a.device == "cuda" else 0
        sets += [
            f"launch.nnodes={a.nodes}",
            f"launch.nproc_per_node={ranks}",
            f"launch.ray.address={a.ray_address}",
            f"launch.ray.gpus_per_node={gpus}",
            f"launch.ray.cpus_per_node={a.ray_cpus}",
        ]
    else:
        sets += [
            f"launch.nnodes={a.nodes}",
            f"launch.nproc_per_node={ranks}",
            f"launch.docker.nodes=[{a.engine}]",
            f"launch.docker.image={a.image}",
            "launch.docker.gpus=0",
            f"launch.docker.volumes={json.dumps([*a.volume, f'{REPO}:{REPO}:ro'])}",
            f"launch.docker.env={json.dumps({'PYTHONPATH': str(REPO), **dict(e.split('=', 1) for e in a.env)})}",
        ]
        if a.device == "cuda":  # GPUs as device nodes: no container toolkit needed (lmyard.launch.gpus)
            sets += ["launch.docker.gpu_mode=devices", f"launch.docker.node_gpus={json.dumps(a.node_gpus)}"]
    return load_recipe("smoke", [*sets, *a.overrides])


def run(a, cfg, shards: dict, on_step=None) -> dict:
    """One launch; its step lines parsed (tok/s, loss), its result or the error it ended with."""
    steps: list[tuple[int, float, float]] = []

    def line(text: str) -> None:
        print(text, flush=True)
        if m := STEP.search(text):
            steps.append((int(m[1]), float(m[2]), float(m[3].replace(",", ""))))
            if on_step:
                on_step(int(m[1]))

    spec = TrainSpec(config=cfg, shards=ShardSet.model_validate(shards))
    try:
        result = launch(spec, line)
        ended = {"status": result.status, "start_step": result.start_step, "step": result.step}
    except (StageFailed, UserError) as e:
        ended = {"status": type(e).__name__, "message": str(e).splitlines()[0]}
    timed = [s[2] for s in steps[2:]] or [s[2] for s in steps]
    return {
        "backend": cfg.launch.backend,
        "tok_s": round(statistics.median(timed)) if timed else None,
        "loss": {s[0]: s[1] for s in steps},
        **ended,
    }


def drill(a, store: Path, shards: dict) -> None:
    """SIGTERM or kill one container mid-run, then the retry: how each attempt ended, and what was left."""
    import docker

    client = docker.DockerClient(base_url=a.engine)
    run_name = f"drill-{a.drill}"
    cfg = config(a, store, "docker", run_name)
    fired = threading.Event()

    def act(step: int) -> None:
        if step >= a.drill_step and not fired.is_set():
            fired.set()
            victim = client.containers.list(filters={"label": [f"{LABEL}.run_name={run_name}", f"{LABEL}.node=1"]})
            victim[0].kill(signal="SIGTERM" if a.drill == "sigterm" else "SIGKILL")

    first = run(a, cfg, shards, act)
    left = client.containers.list(all=True, filters={"label": f"{LABEL}.run_name={run_name}"})
    retry = run(a, cfg, shards)
    print(json.dumps({"drill": a.drill, "first": first, "containers_left": len(left), "retry": retry}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="unix:///var/run/docker.sock")
    ap.add_argument("--image", help="docker: an image with torch; lmyard comes from the mounted checkout")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--node-gpus", nargs="+", default=["0", "1"], help="GPU indices of each node, e.g. 0,1 2,3")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a check of the script itself")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per node with --device cpu")
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--checkpoint-interval", type=int, default=100000)
    ap.add_argument("--volume", action="append", default=[], help="host:container[:ro] for the containers")
    ap.add_argument("--env", action="append", default=[], help="K=V in the containers")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="dotted.key=value, both backends")
    ap.add_argument("--backends", nargs="+", default=["local", "docker"], choices=["local", "docker", "ray"])
    ap.add_argument("--ray-address", help="a Ray cluster to use (default: start a local one of --nodes nodes)")
    ap.add_argument("--ray-cpus", type=int, default=4, help="CPUs of each Ray node (and of its bundle)")
    ap.add_argument("--drill", choices=["sigterm", "kill"])
    ap.add_argument("--drill-step", type=int, default=20)
    ap.add_argument("--store", type=Path, help="a local store folder (default: a new temporary one)")
    a = ap.parse_args()
    if "docker" in a.backends and not a.image:
        ap.error("--image is needed for the docker backend")
    if a.device == "cuda" and len(a.node_gpus) != a.nodes:
        ap.error(f"--node-gpus names {len(a.node_gpus)} nodes' GPUs; --nodes is {a.nodes}")
    a.store = a.store or Path(tempfile.mkdtemp(prefix="lmyard-bench-backends-"))
    shards = make_shards(a.store, 32 * 1024 * 1024)
    if a.drill:
        return drill(a, a.store, shards)
    rows = {}
    with contextlib.ExitStack() as stack:
        if "ray" in a.backends and not a.ray_address:
            a.ray_address = stack.enter_context(ray_cluster(a))
        for backend in a.backends:
            rows[backend] = run(a, config(a, a.store, backend, f"bench-{backend}"), shards)
            print(json.dumps(rows[backend]), flush=True)
    for backend in ("docker", "ray"):
        if {"local", backend} <= rows.keys() and rows["local"]["tok_s"] and rows[backend]["tok_s"]:
            print(json.dumps({f"{backend}_over_local": round(rows[backend]["tok_s"] / rows["local"]["tok_s"], 4)}))


CLUSTER = """
import json, sys
from ray.cluster_utils import Cluster
nodes = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args=nodes[0])
for node in nodes[1:]:
    cluster.add_node(**node)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the benchmark closes it
cluster.shutdown()
"""


@contextlib.contextmanager
def ray_cluster(a: argparse.Namespace):
    """A local Ray cluster of --nodes nodes on this host, node i seeing only --node-gpus[i]; its address.

    The cluster lives in a process of its own, as a real one would, and ends when this context does."""
    import subprocess

    def node(i: int) -> dict:
        args: dict = {"num_cpus": a.ray_cpus, "include_dashboard": False}
        if a.device == "cuda":
            gpus = a.node_gpus[i]
            args |= {"num_gpus": len(gpus.split(",")), "env_vars": {"CUDA_VISIBLE_DEVICES": gpus}}
        return args

    nodes = json.dumps([node(i) for i in range(a.nodes)])
    proc = subprocess.Popen(
        [sys.executable, "-c", CLUSTER, nodes], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = proc.stdout.readline().strip() if proc.stdout else ""
        if not address:
            raise SystemExit(f"the local Ray cluster did not start (exit {proc.wait()})")
        print(f"ray: a local cluster of {a.nodes} nodes at {address}", flush=True)
        yield address
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=120)


if __name__ == "__main__":
    main()
