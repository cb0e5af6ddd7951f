"""What several tasks share."""

from __future__ import annotations

from lmyard.errors import UserError


def not_a_user_error(task, task_run, state) -> bool:
    """Retry condition: retrying cannot fix bad input, so a UserError is not retried."""
    return not isinstance(state.result(raise_on_failure=False), UserError)


def artifact_key(run_name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for one run."""
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower())
    return f"{slug}-{what}"
