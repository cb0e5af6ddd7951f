"""The flow's look for new checkpoints while the store is briefly unreachable: it waits the blip out."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import pytest
from conftest import tiny_overrides
from tcp_proxy import TcpProxy

from lmyard.recipes import load_recipe
from lmyard.run import Run
from lmyard.store import open_store
from lmyard.tracking.lineage import Lineage

pytestmark = pytest.mark.slow


class _Training:
    """What new_checkpoints needs of the train task's future: wait, and whether it has ended."""

    def __init__(self):
        self.done = threading.Event()
        self.state = self

    def wait(self, timeout: float) -> None:
        self.done.wait(timeout)

    def is_final(self) -> bool:
        return self.done.is_set()


def _commit(store, run_name: str, step: int) -> None:
    from lmyard.layout import RunLayout

    store.write_bytes(RunLayout(run_name).manifest(step), b'{"files": {}}')


def test_a_store_blip_while_looking_for_checkpoints_does_not_end_the_flow(s3_server, s3_bucket, tmp_path, monkeypatch):
    from tasks.evaluate import new_checkpoints

    proxy = TcpProxy(urlparse(s3_server.endpoint).port)
    proxy.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    cfg = load_recipe(
        "smoke",
        tiny_overrides(
            tmp_path, **{"store": f"s3://{s3_bucket}/s", "run_name": "blip", "eval.poll_s": 0.5, "train.max_steps": 100}
        ),
    )
    store = open_store(cfg.store)
    lineage = Lineage.open(cfg, Run(cfg.run_name, store), shard_address="a", code_version="test")
    training, said = _Training(), []
    seen: list[int] = []

    def drive() -> None:
        _commit(store, "blip", 10)
        while 10 not in seen:
            time.sleep(0.1)
        proxy.stop()  # the store is unreachable for 6 s, while the flow keeps looking
        time.sleep(6)
        proxy.start()
        _commit(open_store(cfg.store), "blip", 20)
        while 20 not in seen:
            time.sleep(0.1)
        training.done.set()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        for step in new_checkpoints(cfg, lineage, training, log=said.append):
            seen.append(step)
    finally:
        proxy.stop()
    assert seen == [10, 20]
    assert said and all("looking for new checkpoints failed" in s and "trying again" in s for s in said)


class _Enough(BaseException):
    """Ends the look for checkpoints from inside it (not an Exception: the look's own handler lets it through)."""


def test_the_look_for_checkpoints_waits_between_tries_while_the_store_is_down_after_training(
    s3_server, tmp_path, monkeypatch
):
    """Training has ended and the bucket is gone: the flow tries again every eval.poll_s, saying so once, rather
    than spinning (it once printed one warning thousands of times in 40 s)."""
    import tasks.evaluate as evaluate

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    cfg = load_recipe(
        "smoke",
        tiny_overrides(tmp_path, **{"store": f"s3://{(bucket := s3_server.new_bucket())}/s", "eval.poll_s": 0.5}),
    )
    lineage = Lineage.open(cfg, Run.of(cfg), shard_address="a", code_version="test")
    s3_server.remove_bucket(bucket)  # deleted mid-run
    training, said, looks = _Training(), [], []
    training.done.set()
    look = evaluate._unevaluated

    def counted(*args, **kwargs):
        if len(looks) == 4:
            raise _Enough
        looks.append(time.monotonic())
        return look(*args, **kwargs)

    monkeypatch.setattr(evaluate, "_unevaluated", counted)
    with pytest.raises(_Enough):
        list(evaluate.new_checkpoints(cfg, lineage, training, log=said.append))
    gaps = [b - a for a, b in zip(looks, looks[1:], strict=False)]
    assert min(gaps) >= 0.5 * 0.95, f"looks {gaps} s apart at eval.poll_s=0.5"  # however slow each look is
    assert len(said) == 1 and "looking for new checkpoints failed" in said[0] and "does not exist" in said[0], said
