"""The local backend: every node a process group on this machine (lmyard.launch.local_job.LocalJob)."""

from __future__ import annotations

from lmyard.backends.base import Backend

BACKEND = Backend(name="local", job="lmyard.launch.local_job:LocalJob.for_stage", on_flow_host=True)
