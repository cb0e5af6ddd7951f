"""MLflow's INFO and WARNING lines and its download bars off, wherever lmyard runs.

The command line (lmyard.console), a flow run under a Prefect worker (the pretrain and sweep flows), every
stage's process (lmyard.stages.entry) and `lmyard eval` call `quiet_mlflow` first: their logs are lmyard's own.
The processes they start inherit the environment. An operator's own settings win.
"""

from __future__ import annotations

import logging
import os


def quiet_mlflow() -> None:
    """MLFLOW_LOGGING_LEVEL=ERROR (read as MLflow is imported) and no artifact download bars (read at each
    download), unless set; MLflow's logger directly when it is imported already."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if os.environ["MLFLOW_LOGGING_LEVEL"] == "ERROR":
        logging.getLogger("mlflow").setLevel(logging.ERROR)
