"""Launch a training run from the host this runs in (tests/integration/test_hosts.py runs it in the services host, the
launching machine of a multi-host run; tests/integration/test_hosts_ray.py beside host a's Ray node): shard, open the
lineage, follow the containers (launch.backend=docker) or the Ray actors (ray) through lmyard's launcher, recording
its attempts as the train task does.

    python tests/launch_on_host.py OUT.json --set KEY=VALUE ...

Writes {"result": TrainResult, "lines": [...], "times": [...], "mlflow_run_id": ...}, or {"error", "error_type",
"exit_code", "lines"} when the launch fails. `--evaluate`: then the evaluate stage on the same backend, its
EvalResult as "evaluation" and its lines as "eval_lines".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lmyard.data.sharding import tokenize_and_shard
from lmyard.errors import UserError
from lmyard.launch.elastic import attempt_hosts, record_resize
from lmyard.launch.launcher import launch
from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.stages import EvalSpec, TrainSpec
from lmyard.tracking.lineage import Lineage


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--set", action="append", default=[], dest="sets")
    p.add_argument("--flow-run-id", default="hosts")
    p.add_argument("--evaluate", action="store_true")
    args = p.parse_args()
    cfg = load_recipe("smoke", args.sets)
    lines: list[str] = []
    times: list[float] = []  # when each line was said (time.time())
    out: dict = {"lines": lines, "times": times}

    def say(line: str) -> None:
        times.append(time.time())
        lines.append(line)

    try:
        shards, _ = tokenize_and_shard(cfg, log=say)
        lineage = Lineage.open(cfg, Run.of(cfg), shard_address=shards.address, code_version="test")
        lineage = lineage.record_attempt(
            resumed_from=None, start_step=0, info={"nodes": cfg.launch.nnodes, "hosts": ", ".join(attempt_hosts(cfg))}
        )
        out["mlflow_run_id"] = lineage.ref.mlflow_run_id
        spec = {"config": cfg.model_dump(mode="json"), "shards": shards.to_dict(), "lineage": lineage.to_dict()}

        def resized(r):  # as the train task records it (tasks/train.py)
            nonlocal lineage
            lineage = record_resize(lineage, r)
            return lineage.ref

        def started(s):
            lineage.record_resume(resumed_from=s.resumed_from, start_step=s.start_step, hosts=s.hosts)

        result = launch(
            TrainSpec.model_validate(spec),
            on_line=say,
            flow_run_id=args.flow_run_id,
            on_resize=resized,
            on_started=started,
        )
        lineage.end_attempt("finished", f"step {result.step}")
        out["result"] = result.model_dump(mode="json")
        if args.evaluate:
            out["eval_lines"] = eval_lines = []
            evaluation = launch(EvalSpec(config=cfg, shards=shards), on_line=eval_lines.append)
            out["evaluation"] = {**evaluation.model_dump(mode="json"), "val_loss": evaluation.val_loss}
    except Exception as e:
        out.update(error=str(e), error_type=type(e).__name__, exit_code=getattr(e, "exit_code", None))
        if not isinstance(e, UserError):
            import traceback

            say(traceback.format_exc())
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0 if "result" in out else 1


if __name__ == "__main__":
    sys.exit(main())
