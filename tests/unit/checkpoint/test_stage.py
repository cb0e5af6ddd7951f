"""Serializing a `full` checkpoint into its staging folder (lmyard.checkpoint.full.stage)."""

from __future__ import annotations

import hashlib
import json

import torch

from lmyard.checkpoint import manifest as manifest_module
from lmyard.checkpoint.full import FILES, stage
from lmyard.checkpoint.manifest import StreamHash, file_meta, matches


def _tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tree = {f"w{i}": torch.randn(64 + i, 33, generator=g) for i in range(6)}
    return {**tree, "big": torch.randn(700, 500, generator=g)}  # over _HashingFile.AT_ONCE: hashed on threads


def test_files_written_at_once_each_carry_their_own_bytes_sha256_and_pieces_and_load_back_equal(tmp_path, monkeypatch):
    """The model's, optimizer's and RNG files are written by one thread each: every manifest entry must still be
    the sha256 (and, over one piece, the piece hashes) of that file's own bytes, and every file loads back whole."""
    monkeypatch.setattr(manifest_module, "PIECE_BYTES", 16 << 10)  # the tensors' files span several pieces
    model, optim = _tree(0), {"state": {0: _tree(1)}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    rng = [torch.get_rng_state(), {"python": 7}]
    state = {"step": 12, "val_loss": 3.5, "world_size": 2}
    folder = tmp_path / "step_00000012"
    for crc in (True, False):  # what torch.save writes with its CRC32 on (the default) and off (the checkpointer's)
        torch.serialization.set_crc32_options(crc)
        try:
            manifest = stage(str(folder), model, optim, rng, state)
        finally:
            torch.serialization.set_crc32_options(True)
        assert (manifest.step, manifest.val_loss, manifest.world_size) == (12, 3.5, 2)
        assert sorted(manifest.files) == sorted(FILES)
        for name, meta in manifest.files.items():
            data = (folder / name).read_bytes()
            assert (meta.bytes, meta.sha256) == (len(data), hashlib.sha256(data).hexdigest()), name
            assert matches(str(folder / name), meta), name
        assert manifest.files["optim.pt"].pieces and len(manifest.files["optim.pt"].pieces) > 1
        loaded = {n: torch.load(folder / n, weights_only=True, mmap=True) for n in ("model.pt", "optim.pt", "rng.pt")}
        assert all(torch.equal(loaded["model.pt"][k], v) for k, v in model.items())
        assert all(torch.equal(loaded["optim.pt"]["state"][0][k], v) for k, v in optim["state"][0].items())
        assert torch.equal(loaded["rng.pt"][0], rng[0]) and loaded["rng.pt"][1] == {"python": 7}
        assert json.loads((folder / "state.json").read_text()) == state


def test_bytes_hashed_as_they_are_written_give_the_file_meta_of_the_written_file(tmp_path, monkeypatch):
    """Writes split across piece boundaries, one piece exactly, a partial last piece and a file of under one piece:
    the streamed sha256 and piece hashes must equal those `file_meta` reads back from the file."""
    monkeypatch.setattr(manifest_module, "PIECE_BYTES", 1000)
    rand = torch.Generator().manual_seed(3)
    for sizes in ([30, 2500, 16, 1000, 7, 447], [1000, 1000], [400, 600], [999], [1, 1000, 999]):
        streamed, path = StreamHash(), tmp_path / "file"
        with open(path, "wb") as f:
            for n in sizes:
                data = memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rand).numpy().tobytes())
                f.write(data)
                streamed.update(data)
                streamed.update_pieces(data)
        assert streamed.meta() == file_meta(str(path)), sizes
