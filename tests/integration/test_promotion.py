"""Promotion against real servers: the eval gates of the register step (judge) on the finished run's logged
metrics, the approval step (Prefect's pause_flow_run with input) before the alias moves, and deploy/automations.yaml's
notification received by a webhook on 127.0.0.1 from the session's Prefect server.

The flows here run in this process on the session's Prefect server; they call the register step's own functions
(tasks.register.judge, approve_promotion) on the registered version models:/smoke/1 of the shared finished run."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import tiny_overrides
from prefect import flow, tags
from prefect.context import FlowRunContext

from lmyard.recipes import load_recipe
from lmyard.stages import EvalResult, Score
from lmyard.tracking.lineage import Lineage, LineageRef
from tasks.register import approve_promotion, judge
from tasks.results import Evaluation, RegisteredModel

pytestmark = pytest.mark.slow
STARTED: list = []  # the ids of the flow runs started here, newest last


@flow(name="promote-smoke")
def promote_smoke(config, lineage: dict) -> dict:
    """The register step's decision on the finished run's version 1 (its final evaluation: the val loss the run
    logged at step 6), then its approval step."""
    STARTED.append(FlowRunContext.get().flow_run.id)  # type: ignore[union-attr]
    run = Lineage.from_dict(lineage)
    val = run.metric_history("loss/eval")[6]
    scores = {"val_loss": Score(metrics={"loss/eval": val})}
    result = EvalResult(step=6, checkpoint="-", tokens_seen=6 * 1024, device="cpu", scores=scores)
    gates = judge(config, run, Evaluation(step=6, checkpoint="-", result=result), "smoke", "1")
    model = RegisteredModel(name="smoke", version="1", gates=gates, source="-", model_uri="models:/smoke/1")
    return approve_promotion(config, run, model).model_dump()


def _config(tmp_path, *gates: str, approval: bool = True):
    return load_recipe(
        "smoke",
        tiny_overrides(tmp_path, **{"eval.approval": approval, "eval.approval_timeout_s": 300})
        + [f"eval.gates.metrics=[{', '.join(gates)}]"],
    )


def _lineage(tracking: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    (version,) = client.search_model_versions("name = 'smoke'")
    run = client.get_run(version.run_id)
    ref = LineageRef(
        run_name="smoke",
        tracking_uri=tracking,
        experiment_id=run.info.experiment_id,
        mlflow_run_id=version.run_id,
        attempt=1,
        resumed_from=None,
        start_step=0,
    )
    return Lineage(ref).to_dict()


def _aliases(tracking: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    return list(MlflowClient(tracking).get_model_version("smoke", "1").aliases)


def test_a_failing_gate_keeps_the_alias_away_and_asks_no_approval(finished_run, tmp_path):
    _, _, tracking = finished_run
    config = _config(tmp_path, "{metric: loss/val, max: 100}", "{metric: loss/train, max: 0.01}")
    aliases = _aliases(tracking)
    with tags("lmyard"):
        state = promote_smoke(config, _lineage(tracking), return_state=True)
    model = state.result()
    assert model["gates"]["loss/val max"]["passed"] and not model["gates"]["loss/train max"]["passed"]
    assert 0.01 < model["gates"]["loss/train max"]["value"] < 100
    assert model["alias"] is None and _aliases(tracking) == aliases


def test_promotion_waits_for_approval_and_moves_the_alias_once_resumed_with_approve(finished_run, tmp_path):
    """The flow run pauses (state Paused) until it is resumed with the Approval input; then @candidate is set."""
    from prefect import resume_flow_run
    from prefect.client.orchestration import get_client

    _, _, tracking = finished_run
    config = _config(tmp_path, "{metric: loss/eval, max: 100}", "{metric: loss/val, max: 100}")
    before = len(STARTED)
    done: dict = {}

    def run() -> None:
        with tags("lmyard"):
            done["model"] = promote_smoke(config, _lineage(tracking))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    with get_client(sync_client=True) as client:
        while not (len(STARTED) > before and client.read_flow_run(STARTED[-1]).state.is_paused()):  # type: ignore[union-attr]
            assert time.monotonic() < deadline and thread.is_alive(), f"no paused flow run: {done}"
            time.sleep(0.5)
        # the form's description: the version, its source run and the gate values against their thresholds
        keyset = client.read_flow_run(STARTED[-1]).state.state_details.run_input_keyset  # type: ignore[union-attr]
        form = json.loads(client.read_flow_run_input(STARTED[-1], keyset["description"]))
    assert "candidate" not in _aliases(tracking)
    assert "Promote smoke version 1 to @candidate" in form and f"{tracking}/#/models/smoke/versions/1" in form, form
    assert re.search(r"\| loss/eval max \| [0-9.]+ \| 100 \| pass \|", form) and "/runs/" in form, form
    resume_flow_run(STARTED[-1], run_input={"approve": True, "note": "val loss fine"})
    thread.join(180)
    assert not thread.is_alive() and done["model"]["alias"] == "candidate"
    assert "candidate" in _aliases(tracking)
    from mlflow.tracking import MlflowClient

    version = MlflowClient(tracking).get_model_version("smoke", "1")
    assert version.tags["lmyard.approval.note"] == "val loss fine" and version.tags["lmyard.approval.approved_at"]


@pytest.fixture
def webhook():
    """A webhook receiver on 127.0.0.1: the JSON bodies POSTed to it, in order."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    server.shutdown()


@flow(name="lmyard-fails")
def fails() -> None:
    raise RuntimeError("a failed run")


def test_the_notification_automation_posts_failed_completed_and_gates_passed_to_a_webhook(
    finished_run, tmp_path, webhook
):
    from prefect.client.orchestration import get_client

    from flows.notifications import install

    url, received = webhook
    (created,) = install(url, block="lmyard-notify-test")
    assert created[0] == "lmyard-notify-runs-and-gates"
    _, _, tracking = finished_run
    config = _config(tmp_path, "{metric: loss/eval, max: 100}", approval=False)
    try:
        with tags("lmyard"):
            promote_smoke(config, _lineage(tracking))  # gates pass: lmyard.gates.passed, then Completed
            assert fails(return_state=True).is_failed()
        wanted = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "lmyard.gates.passed")
        deadline = time.monotonic() + 180
        while not all(any(b["body"].startswith(w) for b in received) for w in wanted):
            assert time.monotonic() < deadline, f"notifications received: {received}"
            time.sleep(0.5)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_automation(created[1])
    gates = next(b for b in received if b["body"].startswith("lmyard.gates.passed"))
    assert "smoke version 1" in gates["subject"] and "lmyard.model.smoke.1" in gates["body"]
    # the model's URI, the gate values and links to the MLflow run and version
    assert "models:/smoke/1" in gates["body"] and re.search(r"loss/eval max [0-9.]+ \(limit 100\)", gates["body"])
    assert f"{tracking}/#/models/smoke/versions/1" in gates["body"] and "/runs/" in gates["body"], gates["body"]
    failed = next(b for b in received if b["body"].startswith("prefect.flow-run.Failed"))
    assert "prefect.flow-run." in failed["body"]
