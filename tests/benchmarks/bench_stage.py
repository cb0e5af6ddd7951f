"""A checkpoint's serialisation into its staging folder (lmyard.checkpoint.full.stage), the part of a commit that
every SIGTERM waits for, with torch.save's CRC32 on and off, and optionally the stage() of another revision.

    python tests/benchmarks/bench_stage.py --presets gpt2-124m --runs 3
    python tests/benchmarks/bench_stage.py --presets gpt2-124m llama-1b --runs 2 --before 31c3485
    python tests/benchmarks/bench_stage.py --presets gpt2-124m --runs 2 --before e2ce931 --before-crc off

For each preset it makes, in host memory, the trees a `full` checkpoint holds: the model's fp32 weights (the
preset's shapes, its vocabulary or else 50304, a tied weight once) and AdamW's two moments of each; then times
stage() into a temporary folder (`--dir`, default the system's), the folder deleted before each run. `--before REV`
also times the stage() of `git show REV:lmyard/checkpoint/full.py`, with the CRC32 as `--before-crc` says. No GPU: the
copy off the device is not part of it. llama-1b's trees take 18 GB of memory and of the folder's disk.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lmyard.checkpoint.full import stage  # noqa: E402
from lmyard.config import ModelConfig  # noqa: E402
from lmyard.models.registry import build_model, presets  # noqa: E402


def trees(preset: str) -> tuple[dict, dict]:
    """The model's state dict and an AdamW state dict of its shapes, filled (pages faulted in, as a real copy's)."""
    with torch.device("meta"):
        built = build_model(ModelConfig(preset=preset), 50304)
    tensors = {id(v): (k, v) for k, v in reversed(built.state_dict(keep_vars=True).items())}  # a tied weight once
    model = {k: torch.empty(v.shape).uniform_() for k, v in tensors.values()}  # as torch.save writes it
    params = {k: v.shape for k, v in built.named_parameters()}
    state = {
        i: {"step": torch.tensor(1.0), "exp_avg": torch.empty(s).uniform_(), "exp_avg_sq": torch.empty(s).uniform_()}
        for i, s in enumerate(params.values())
    }
    return model, {"state": state, "param_groups": [{"lr": 1e-3, "params": list(state)}]}


def stage_of(rev: str):
    """stage() of lmyard/checkpoint/full.py at git revision `rev`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:lmyard/checkpoint/full.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as folder:  # the module needs its file only while it loads
        path = Path(folder) / "full_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("full_before", path)
        assert spec is not None and spec.loader is not None, "a file path always has a loader"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["gpt2-124m"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--before", help="a git revision whose stage() is timed too")
    p.add_argument(
        "--before-crc",
        choices=["on", "off"],
        default="on",
        help="torch.save's CRC32 for --before's stage(): as that revision's checkpointer set it (off since 841cb21)",
    )
    p.add_argument("--dir", default=None, help="where the staging folder goes (default: a temporary folder)")
    a = p.parse_args()
    if unknown := [name for name in a.presets if name not in presets()]:
        p.error(f"--presets: unknown {', '.join(unknown)}; choose from {', '.join(sorted(presets()))}")
    if a.runs < 1:
        p.error(f"--runs {a.runs}: give at least 1")
    if a.dir and not os.path.isdir(a.dir):
        p.error(f"--dir {a.dir} is not a folder: create it or choose another")
    variants = [("CRC32 on", stage, True), ("CRC32 off", stage, False)]
    if a.before:
        try:
            before = (f"{a.before}, CRC32 {a.before_crc}", stage_of(a.before), a.before_crc == "on")
            variants.insert(0, before)
        except subprocess.CalledProcessError:
            p.error(f"--before {a.before}: git has no lmyard/checkpoint/full.py at that revision in {REPO}")
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench-stage-"))
    try:
        for preset in a.presets:
            model, optim = trees(preset)
            gb = sum(t.nbytes for t in [*model.values(), *(v for st in optim["state"].values() for v in st.values())])
            print(f"{preset}: {gb / 1e9:.2f} GB", flush=True)
            for run in range(a.runs):
                for label, fn, crc in variants:
                    shutil.rmtree(root / "step", ignore_errors=True)
                    torch.serialization.set_crc32_options(crc)
                    t0 = time.perf_counter()
                    fn(str(root / "step"), model, optim, [torch.get_rng_state()], {"step": 1})
                    print(f"  run {run + 1}  {label:24s} {time.perf_counter() - t0:7.2f} s", flush=True)
            del model, optim
    finally:
        torch.serialization.set_crc32_options(True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
