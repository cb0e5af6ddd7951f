"""Hugging Face export and import: transformers loads the folder and computes lmyard's logits; import then
export is the identity; bad inputs are one clear error and leave nothing at the destination (`lmyard export` and
an export to S3: tests/integration/test_export_integration.py)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from conftest import gpt2_ranks_or_skip, save_model_checkpoint
from conftest import write_random_checkpoint as write_checkpoint

from lmyard.errors import UserError
from lmyard.export import hf as export

transformers = pytest.importorskip("transformers", reason="the export tests load folders with transformers (dev extra)")

TEXTS = [
    "The for statement is used to iterate",
    "Exceptions are raised when  \n\n an error\tis detected",
    "don't it's we'll 123456 3.14",
    "émoji 🎉 中文 <|endoftext|> after",
]


def hf_logits(folder: str, ids: torch.Tensor, hf_arch: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == hf_arch
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    "arch,tokenizer,bias",
    [("gpt2", "bytes", True), ("gpt2", "gpt2", True), ("gpt2", "bytes", False), ("llama", "bytes", False)],
)
def test_transformers_loads_the_export_and_its_logits_equal_lmyards(tmp_path, arch, tokenizer, bias):
    if tokenizer == "gpt2":
        gpt2_ranks_or_skip()

    from lmyard.data.tokenizer import _load

    uri, model = write_checkpoint(tmp_path / "store", tokenizer, arch=arch, bias=bias)  # GPT-2 without biases: zeros
    info = export.export(uri, str(tmp_path / "hf"), cache_dir=str(tmp_path / "cache"))
    hf_arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    assert info["step"] == 5 and info["hf_architecture"] == hf_arch
    folder = str(tmp_path / "hf")
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "lmyard_export.json",
    } <= set(os.listdir(folder))

    enc = _load(tokenizer, None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:  # the tokenizer.json encodes and decodes as the run's tiktoken encoding
        ids = hf_tok.encode(text)
        assert ids == enc.encode(text, allowed_special="all")
        assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == enc.eot_token

    ids = torch.tensor([enc.encode_ordinary(" ".join(TEXTS) * 3)[:64], enc.encode_ordinary(TEXTS[1] * 5)[:64]])
    with torch.no_grad():
        ours = model(ids)
    theirs = hf_logits(folder, ids, hf_arch)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(enc.n_vocab, model.config.vocab_size))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_then_export_is_the_identity(tmp_path, arch):
    from safetensors.torch import load_file

    from lmyard.models.registry import model_from_spec

    uri, model = write_checkpoint(tmp_path / "store", arch=arch)
    export.export(uri, str(tmp_path / "first"), cache_dir=str(tmp_path / "cache"))
    sd, spec = export.init_from_hf(str(tmp_path / "first"))
    imported = model_from_spec(spec)
    assert type(imported) is type(model) and imported.config == model.config
    imported.load_state_dict(sd)
    for name, tensor in model.state_dict().items():  # lmyard -> HF -> lmyard gives back every tensor
        assert torch.equal(imported.state_dict()[name], tensor), name
    again = save_model_checkpoint(tmp_path / "store", imported, step=7)
    export.export(again, str(tmp_path / "second"), cache_dir=str(tmp_path / "cache"))
    first, second = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("first", "second"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # HF -> lmyard -> HF too
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "first" / name).read_text() == (tmp_path / "second" / name).read_text()


def test_exported_folder_is_readable_by_other_users(tmp_path):
    """0755 for the folder and 0644 for its files under a 022 umask (mkdtemp alone gives 0700, safetensors 0600);
    a stricter umask still applies."""
    uri, _ = write_checkpoint(tmp_path / "store")
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        old = os.umask(umask)
        try:
            dest = tmp_path / f"hf-{umask:o}"
            export.export(uri, str(dest), cache_dir=str(tmp_path / "cache"))
        finally:
            os.umask(old)
        assert stat.S_IMODE(dest.stat().st_mode) == folder_mode
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()}
        assert "model.safetensors" in files and set(files.values()) == {file_mode}, files


def _nothing_written(dest) -> bool:
    leftovers = [n for n in os.listdir(dest.parent) if n.startswith(".lmyard-export-")] if dest.parent.exists() else []
    return not dest.exists() and not leftovers


def test_bad_inputs_are_one_clear_error_and_leave_nothing_at_the_destination(tmp_path):
    store = tmp_path / "store"
    uri, _ = write_checkpoint(store, step=5)
    write_checkpoint(store, step=10)
    cache = str(tmp_path / "cache")
    dest = tmp_path / "out" / "hf"

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="exists and is not empty"):
        export.export(uri, str(full), cache_dir=cache)
    assert os.listdir(full) == ["keep.txt"]

    with pytest.raises(UserError, match="not a run or a checkpoint"):
        export.export(str(tmp_path / "elsewhere"), str(dest), cache_dir=cache)

    (store / "runs/r/checkpoints/step_00000010/manifest.json").unlink()  # incomplete: no manifest
    with pytest.raises(UserError, match=r"step_00000010 is incomplete \(no manifest.json\); complete steps: \[5\]"):
        export.export(f"{store}/runs/r", str(dest), step=10, cache_dir=cache)
    assert _nothing_written(dest)

    model_pt = store / "runs/r/checkpoints/step_00000005/model.pt"
    model_pt.write_bytes(model_pt.read_bytes()[:-100])  # damaged: truncated
    with pytest.raises(UserError, match=r"step_00000005 is damaged .*--step"):
        export.export(f"{store}/runs/r", str(dest), cache_dir=cache)  # the newest complete one
    assert _nothing_written(dest)

    other, _ = write_checkpoint(tmp_path / "other", spec_arch="mamba")
    with pytest.raises(
        UserError, match="architecture 'mamba', which lmyard cannot export: known architectures are gpt2, llama"
    ):
        export.export(other, str(dest), cache_dir=cache)
    assert _nothing_written(dest)

    with pytest.raises(UserError, match="is not a folder"):
        export.init_from_hf(str(tmp_path / "missing"))
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    with pytest.raises(UserError, match=r"\['MistralForCausalLM'\] is not one lmyard can load"):
        export.init_from_hf(str(tmp_path / "mistral"))


def test_export_of_a_run_without_checkpoints_names_its_checkpoints_folder(tmp_path):
    (tmp_path / "store" / "runs" / "empty").mkdir(parents=True)
    with pytest.raises(UserError, match=r"runs/empty/checkpoints holds no complete checkpoint"):
        export.export(f"{tmp_path / 'store'}/runs/empty", str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))
