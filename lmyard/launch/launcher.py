"""The one launcher: run a stage on the configured backend and follow it to its result.

    result = launch(EvalSpec(config=config, shards=shards, step=600), on_line=log.info)

`launch.backend` names a row of the backend table (lmyard.backends), whose `job` makes the `Job` (`local`:
lmyard.launch.local_job.LocalJob, a process group here; `docker`: lmyard.launch.docker_job.DockerJob, the stage
image; `ray`: lmyard.launch.ray.RayJob, one actor per node of a placement group for training, one actor on a
cluster node for the other stages); the same `Follower` follows every stage on every backend, so output, the
watchdog, cancellation, cleanup and result reading exist once. A training with launch.min_nnodes below
launch.nnodes goes through lmyard.launch.elastic, which relaunches it on the healthy nodes when one is lost.
Nothing in flows/ or tasks/ starts a process any other way.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable

from lmyard import backends
from lmyard.config import RunConfig
from lmyard.launch.elastic import run_elastic
from lmyard.launch.follower import Follower
from lmyard.launch.job import Job, JobFactory
from lmyard.paths import no_space
from lmyard.stages import StageSpec, TrainSpec


def launch(
    spec: StageSpec,
    on_line: Callable[[str], None] = print,
    *,
    flow_run_id: str | None = None,
    **callbacks,
):
    """Run `spec`'s stage on its config's launch.backend; its result (`type(spec).result`), or the error of
    lmyard.errors that its exit code names. `callbacks`: on_progress, on_started, on_resize (training; a run below
    launch.nnodes after a lost node, lmyard.launch.elastic)."""
    try:
        return _launch(spec, on_line, flow_run_id=flow_run_id, **callbacks)
    except OSError as e:  # the launch folder under LMYARD_CACHE on a full disk: one line, exit 4, not retried
        full = no_space(e)
        if full is None:
            raise
        raise full from None


def _launch(spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None, **callbacks):
    make: JobFactory = pkgutil.resolve_name(backends.of(spec.config).job)

    def make_job(config: RunConfig, spec: StageSpec) -> Job:
        return make(config, spec, on_line, flow_run_id=flow_run_id)

    on_resize = callbacks.pop("on_resize", None)
    if isinstance(spec, TrainSpec) and spec.config.launch.fewest_nodes() < spec.config.launch.nnodes:
        return run_elastic(spec, on_line, make_job, on_resize=on_resize, **callbacks)  # lmyard.launch.elastic
    return Follower(make_job(spec.config, spec), spec.config, on_line, **callbacks).run()
