"""The crashed-run flow: close the lineage of a flow run that died with its worker (deploy/prefect.yaml
runs it on every `prefect.flow-run.Crashed` event)."""

from __future__ import annotations

from prefect import flow

from tasks.lineage import close_crashed_lineage


@flow(name="lineage-crashed")
def lineage_crashed(flow_run_id: str) -> str | None:
    """Mark the MLflow run of the crashed flow run's lineage FAILED (if still RUNNING); its id."""
    return close_crashed_lineage(flow_run_id)
