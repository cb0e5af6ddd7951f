"""The trainer's metric sink: exactly one rank logs, and only `MLflowSink` talks to MLflow.

Training code logs through `MetricsSink`: rank 0 of the job gets an `MLflowSink`
on the lineage's run, every other rank (and a run without a lineage) a `NullSink`.
The sink owns its own MLflow client: it lives in the trainer's process, apart
from the flow's `Lineage` (lmyard.tracking.lineage).

Design notes: docs/tracking.md, `lmyard/tracking/sink.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from lmyard.config import redact_uri
from lmyard.tracking.client import mlflow_client
from lmyard.tracking.lineage import LineageRef
from lmyard.tracking.schema import GOODPUT_METRICS, RESTART_METRICS


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def latest(self, prefix: str) -> dict[str, float]: ...
    def flush(self, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def latest(self, prefix: str) -> dict[str, float]:
        return {}

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class MLflowSink:
    """Sends metrics to one MLflow run in batches, from a background thread: logging never stalls a step.

    Each key's points at or below the highest step the run already holds are
    dropped (see the module docstring), so a resumed attempt does not log a
    step twice. A batch that cannot be sent is kept and sent with the next one;
    the first failure of each kind is reported at once, in one line. A send that
    has not returned after `SLOW_S` (MLflow's client retries a server that is
    down for minutes before it raises) is reported too, once, and so is its end.
    Training never fails for tracking: what still cannot be sent at close() is
    counted in one warning line.
    """

    SLOW_S = 30.0  # a send still waiting for the tracking server this long is said, once per outage

    def __init__(self, tracking_uri: str, run_id: str):
        import queue
        import threading

        self.client, self.run_id = mlflow_client(tracking_uri), run_id
        self.queue: queue.Queue = queue.Queue()
        self.floor: dict[str, int] | None = None  # key -> highest step the run holds; read by the thread
        self.skipped = 0
        self.said: set[str] = set()  # the kinds of points not sent already reported
        self.sent: dict[str, int] = {}  # key -> highest step this attempt sent
        self.unsent: list = []  # points not sent yet (the server could not be reached), oldest first
        self.warned: set[str] = set()  # kinds of send errors already reported
        self.behind: threading.Event | None = None  # the marker of the last flush that timed out
        self.sending_since: float | None = None  # monotonic start of the send under way, if any
        self.said_slow = False  # the send under way was reported as waiting
        self.thread = threading.Thread(target=self._send, daemon=True, name="mlflow-sink")
        self.thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.queue.put([Metric(k, float(v), now, step) for k, v in metrics.items()])
        self._say_if_waiting()

    def latest(self, prefix: str) -> dict[str, float]:
        """The run's latest value of each metric under `prefix` (earlier attempts' records); {} when the server
        cannot be read (training never fails for tracking)."""
        try:
            metrics = self.client.get_run(self.run_id).data.metrics
        except Exception as e:
            print(
                f"metrics: could not read the run's {prefix}* metrics ({type(e).__name__}); starting from 0", flush=True
            )
            return {}
        return {k: v for k, v in metrics.items() if k.startswith(prefix)}

    def _say_if_waiting(self) -> None:
        """From the training thread (the sender is the one waiting): one line once a send has waited SLOW_S."""
        since = self.sending_since
        if since is not None and not self.said_slow and time.monotonic() - since > self.SLOW_S:
            self.said_slow = True
            print(
                f"metrics: the MLflow server has not answered for {time.monotonic() - since:.0f} s; training goes on, "
                "and the points are kept and sent once it answers",
                flush=True,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything logged so far has been sent, or tried (e.g. before a checkpoint commits), at most
        `timeout` seconds. A flush that timed out leaves the sink *behind* (MLflow hangs): until the sender gets
        past that flush, later flushes with a timeout return at once, so a hung server costs the loop one
        timeout, not one per checkpoint. Nothing is dropped: close() still sends, or counts, every point."""
        import threading

        if timeout is not None and self.behind is not None and not self.behind.is_set():
            return
        done = threading.Event()
        self.queue.put(done)
        if not done.wait(timeout):
            self.behind = done

    def _fresh(self, batch: list) -> list:
        """The points of `batch` to send: one value per step and key. A step the run held before this attempt (an
        earlier attempt logged it) is not sent again; a step this attempt sent already is not either, except the
        goodput totals (the newest record is the truth: the end's, at the last log step's count). Restart times
        are always sent (an attempt's first step can be at or below the floor)."""
        if self.floor is None:
            latest = self.client.get_run(self.run_id).data.to_proto().metrics  # each key's point at its highest step
            self.floor = {m.key: m.step for m in latest}
        out, seen = [], dict(self.sent)
        for m in batch:
            if m.key.startswith(RESTART_METRICS):
                out.append(m)
            elif m.step <= self.floor.get(m.key, -1):
                self._skip("earlier", f"metrics: {m.key} at step {m.step} is already in the MLflow run (an earlier "
                           "attempt logged it); steps logged before are not logged again")  # fmt: skip
            elif m.step <= seen.get(m.key, -1) and not m.key.startswith(GOODPUT_METRICS):
                self._skip("twice", f"metrics: {m.key} was logged twice at step {m.step}; the first value is kept")
            else:
                seen[m.key] = max(m.step, seen.get(m.key, -1))
                out.append(m)
        return out

    def _skip(self, kind: str, line: str) -> None:
        """Count a point not sent; say the first of each kind."""
        if kind not in self.said:
            self.said.add(kind)
            print(line, flush=True)
        self.skipped += 1

    def _deliver(self, batch: list) -> None:
        """Send the unsent points and `batch`, 1000 at a time (MLflow's limit); keep what fails for the next try."""
        self.unsent.extend(batch)
        try:
            self.unsent = self._fresh(self.unsent)
            while self.unsent:
                chunk = self.unsent[:1000]
                self._send_chunk(chunk)
                for m in chunk:
                    self.sent[m.key] = max(m.step, self.sent.get(m.key, -1))
                del self.unsent[: len(chunk)]
        except Exception as e:
            kind = type(e).__name__
            if kind not in self.warned:
                self.warned.add(kind)
                detail = redact_uri(str(e)).splitlines()[0][:300] if str(e) else ""
                print(
                    f"metrics: MLflow logging failed ({kind}: {detail}); "
                    "keeping the points and retrying with the next batch",
                    flush=True,
                )

    def _send_chunk(self, chunk: list) -> None:
        self.sending_since = time.monotonic()
        try:
            self.client.log_batch(self.run_id, metrics=chunk)
        finally:
            waited, self.sending_since = time.monotonic() - self.sending_since, None
            if self.said_slow:
                self.said_slow = False
                print(f"metrics: the MLflow server answers again after {waited:.0f} s", flush=True)

    def _send(self) -> None:
        import threading

        while True:
            item = self.queue.get()
            batch, stop, markers = [], item is None, []
            if isinstance(item, threading.Event):
                markers.append(item)
            elif item is not None:
                batch.extend(item)
            while not stop and not self.queue.empty() and len(batch) < 1000:  # coalesce what queued up meanwhile
                more = self.queue.get()
                if more is None:
                    stop = True
                elif isinstance(more, threading.Event):
                    markers.append(more)
                else:
                    batch.extend(more)
            if batch or self.unsent:
                self._deliver(batch)
            for marker in markers:
                marker.set()
            if stop:
                return

    def close(self) -> None:
        """Send everything queued, then stop. Never raises: points that still cannot be sent are counted in
        one warning line."""
        self.queue.put(None)
        self.thread.join()
        if self.unsent:
            print(
                f"metrics: {len(self.unsent)} metric points could not be sent to MLflow and are lost "
                f"(from step {self.unsent[0].step} on)",
                flush=True,
            )


@contextmanager
def system_metrics(lineage: LineageRef, node_id: str, interval_s: float = 10.0) -> Iterator[None]:
    """Log CPU, memory, disk, network (and GPU, with nvidia-ml-py) metrics of this node meanwhile.

    Keys are `system/<node_id>/...`; a resumed attempt continues the series' steps.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        lineage.mlflow_run_id,
        sampling_interval=interval_s,
        samples_before_logging=1,
        resume_logging=True,
        node_id=node_id,
        tracking_uri=lineage.tracking_uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def metrics_sink(lineage: LineageRef | None, is_main: bool) -> MetricsSink:
    """The sink of one rank: an MLflowSink on the lineage's run for the job's rank 0, else a NullSink."""
    if is_main and lineage is not None:
        return MLflowSink(lineage.tracking_uri, lineage.mlflow_run_id)
    return NullSink()
