"""A registered version's files are downloaded whole before any rank reads them (lmyard.tracking.registered)."""

from __future__ import annotations

import os
import threading
import time

from lmyard.tracking.registered import _downloaded


def _slow_download(calls: list[str]):
    def download(tmp: str) -> str:
        calls.append(tmp)
        folder = os.path.join(tmp, "model")
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{")
            f.flush()
            time.sleep(0.3)  # a reader of this folder now would see half a file
            f.write('"ok": true}')
        return folder

    return download


def test_ranks_resolving_one_version_at_once_each_read_a_complete_copy(tmp_path):
    dest, calls, seen = str(tmp_path / "smoke-1-m"), [], []

    def rank() -> None:
        folder = _downloaded(dest, _slow_download(calls))
        with open(os.path.join(folder, "config.json")) as f:
            seen.append((folder, f.read()))

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [(os.path.join(dest, "model"), '{"ok": true}')] * 3
    assert sorted(os.listdir(tmp_path)) == ["smoke-1-m"]  # no temporary folder left
    _downloaded(dest, _slow_download(calls))
    assert len(calls) == 3  # a complete copy is not downloaded again


def test_a_copy_without_its_marker_is_downloaded_again(tmp_path):
    dest = tmp_path / "smoke-1-m"
    (dest / "model").mkdir(parents=True)
    (dest / "model" / "config.json").write_text("{")  # an interrupted download from before
    folder = _downloaded(str(dest), _slow_download([]))
    assert open(os.path.join(folder, "config.json")).read() == '{"ok": true}'
