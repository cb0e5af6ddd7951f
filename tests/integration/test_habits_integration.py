"""The tiers as pytest collects them: the tests of tests/integration/ (slow, using a server, or marked by hand) are
`integration`, those of tests/unit/ are not (the habits of the code: tests/unit/house/test_habits.py)."""

from __future__ import annotations

import pytest
from conftest import REPO

# ---------------------------------------------------------------- markers


@pytest.mark.integration
def test_integration_marks_slow_tests_and_those_using_a_server_and_leaves_the_unit_tests():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "integration", "-p", "no:cacheprovider"]
        + ["tests/unit/tracking/test_lease.py", "tests/integration/test_lease_integration.py"]
        + ["tests/unit/tracking/test_tracking.py", "tests/integration/test_tracking_integration.py"]
        + ["tests/integration/test_interrupts.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    marked = {line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line}
    assert "test_retention_retires_the_logged_models_of_the_checkpoints_it_deletes" in marked, out.stdout  # a server
    assert "test_second_acquirer_refuses_naming_the_holder[s3]" in marked  # the S3 server, through getfixturevalue
    assert (
        "test_sigterm_to_lmyard_run_commits_the_step_it_stopped_at_exits_143_orphans_no_server_and_the_rerun_resumes"
        in marked
    )  # slow
    assert "test_registered_version_is_listed_on_its_logged_model_and_its_alias_resolves" in marked  # by hand
    assert "test_second_acquirer_refuses_naming_the_holder[local]" not in marked
    assert "test_mlflow_tracking_uri_from_the_environment_is_the_default_and_an_explicit_one_wins" not in marked
