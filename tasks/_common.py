"""What several tasks share."""

from __future__ import annotations

from collections.abc import Callable

from lmyard.errors import UserError
from lmyard.launch.launcher import launch
from lmyard.stages import StageSpec


def not_a_user_error(task, task_run, state) -> bool:
    """Retry condition: retrying cannot fix bad input, so a UserError is not retried."""
    return not isinstance(state.result(raise_on_failure=False), UserError)


def artifact_key(run_name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for one run."""
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower())
    return f"{slug}-{what}"


def launch_stage(spec: StageSpec, on_line: Callable[[str], None], **callbacks):
    """Run a stage (lmyard.stages) through the one launcher on config.launch.backend, labelled with this flow
    run (a retry removes its leftovers); its result contract, or the error its exit code names."""
    from prefect.runtime import flow_run

    return launch(spec, on_line, flow_run_id=flow_run.get_id(), **callbacks)


def flow_run_url() -> str | None:
    """This flow run's page in the Prefect UI; None where the API has no UI (lmyard's temporary server)."""
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    run_id = flow_run.get_id()
    return url_for("flow-run", obj_id=run_id) if run_id else None
