"""torchtitan 0.2.2's Llama 3 trainer on lmyard's shape and tokens: the peer of bench_llama.py.

    . .whl/titan/INSTALL.sh    # on the GPU machines: torchtitan 0.2.2, its missing needs, torchao 0.17
    python tests/benchmarks/run_torchtitan.py --gpus 4 --preset llama-1b --seq 2048 --batch 4 --ac none --compile
    python tests/benchmarks/run_torchtitan.py --gpus 1 --preset llama-1b --compile --float8 rowwise

Why 0.2.2: it is the last torchtitan that runs on the GPU machines' torch 2.11 (0.3.0 imports FSDP2 names
that only newer torch has). Its wheel and what the GPU image lacks (torchdata, tyro with docstring-parser,
typeguard and shtab, tomli, datasets 5 with dill and multiprocess, typing_extensions, and torchao 0.17 for
float8) are carried as wheels: .whl/titan/INSTALL.sh installs them into /tmp/site (see docs/history/benchmarks-log.md).

How it runs torchtitan unchanged: `torchrun ... run_torchtitan.py --worker <torchtitan flags>` starts, in each
rank, torchtitan's own entry point `torchtitan.train.main(Trainer)` after three registrations:

- sys.argv is set to the torchtitan flags first: its ConfigManager.parse_args binds `sys.argv[1:]` as a default
  argument when torchtitan.config is imported;
- the model: a flavor `lmyard-<preset>` (lmyard's preset dimensions: layers, width, heads, kv heads,
  multiple_of, ffn_dim_multiplier, RoPE theta, norm eps, vocabulary) is added to
  `torchtitan.models.llama3.llama3_args`; everything else is torchtitan's Llama 3 (its initialisation, RoPE with
  Llama 3 scaling, RMSNorm, SwiGLU, untied output head as lmyard's). llama-8b's dimensions are those of its
  built-in `8B` flavor;
- the data: the `llama3` TrainSpec is registered again with one change, its data loader: `ShardLoader` reads
  the random-token shard bench_llama.py reads (tests/benchmarks/random_shards.py; `--training.dataset_path`),
  rank r, step s taking sequences (s * world + r) * batch ... + batch of seq + 1 tokens, as bench_llama.py
  does, so both sides see the same tokens. A tokenizer folder is still written (a 3-entry WordLevel vocab.json
  and tokenizer_config.json naming bos/eos, for `--model.hf_assets_path`): torchtitan builds one; the ids come
  already tokenized. bench_titan_target.py points it at a file of real-text rows written in the order lmyard's
  loader reads them, and with `crc_dir` in LMYARD_TITAN each rank writes a checksum of the rows it read
  (BatchCrc). `launch` takes torchtitan flags that replace or add to `titan_flags` (its lr schedule, AdamW
  settings and seed there).

The rest is torchtitan's, set by its own flags: parallelize_llama (activation checkpointing: `selective` is its
op-level policy, `--activation_checkpoint.selective_ac_option op`, as lmyard's; per-block torch.compile of the
model and the loss; FSDP2 with bf16 parameters and fp32 reduction on more than one GPU; on one GPU it trains
under torch.autocast bf16 without FSDP, where lmyard wraps in FSDP2 anyway), AdamW (fused, lr 3e-4, 2 warm-up
steps), gradient clipping at 1.0, checkpoints and validation off. `--float8 tensorwise|rowwise` adds its float8
converter (`--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name R`, torchao's
recipe) with the output head left in bf16 (`filter_fqns output`), as lmyard's train.float8 converts only the
blocks' linears.

`datasets` and torch.utils.tensorboard are imported by torchtitan at module level; where either fails to import
(a pyarrow older than datasets 5 wants, say) it is stubbed: this run reads no HF dataset and logs no
tensorboard. `--device cpu` (a dry run on a CPU machine: gloo, float32) points torchtitan's device helpers at
the CPU (torchtitan assumes an accelerator) and leaves FSDP's gradient divide factor alone (gloo has no
PREMUL_SUM).

Prints one JSON line per GPU count: tokens/s per GPU (torchtitan's `tps`, median of the logged intervals after
warm-up), tokens/s, MFU (torchtitan's own; its FLOP formula is lmyard's), peak reserved memory, last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VERSION = "0.2.2"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.]+).*memory:\s*(-?[\d.]+)GiB.*tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+)%"
)


def tokenizer_folder(path: Path) -> Path:
    """A loadable HF tokenizer folder, made offline: WordLevel vocab.json + tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps({"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": False})
    )
    return path


def ensure_shards(data_dir: Path, tokens: int) -> Path:
    """The random-token train shard bench_llama.py reads (made once, atomically)."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    from random_shards import make_shards

    train = data_dir / "shards" / "bench-random-r50k" / "train_000000.bin"
    if not train.exists() or train.stat().st_size < 1024 + 2 * tokens:
        tmp = Path(tempfile.mkdtemp(dir=data_dir.parent if data_dir.parent.exists() else None))
        make_shards(tmp, tokens)
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "shards").mkdir(exist_ok=True)
        target = data_dir / "shards" / "bench-random-r50k"
        if target.exists():
            import shutil

            shutil.rmtree(target)
        (tmp / "shards" / "bench-random-r50k").rename(target)
    return train


# ------------------------------------------------------------------ inside torchrun: torchtitan itself


def _stub_unused_imports() -> None:
    """Stand-ins for the packages torchtitan imports at module level that this run does not use, where they
    fail to import (see the docstring)."""

    def unavailable(*a, **k):
        raise RuntimeError("not importable here: this benchmark reads lmyard's shard file, without tensorboard")

    stubs = {
        "torch.utils.tensorboard": {"torch.utils.tensorboard": ["SummaryWriter"]},
        "datasets": {
            "datasets": ["Dataset", "load_dataset", "IterableDataset"],
            "datasets.distributed": ["split_dataset_by_node"],
        },
    }
    for package, modules in stubs.items():
        try:
            __import__(package)
        except Exception:  # ImportError, or an incompatible installed dependency failing at import
            for module, names in modules.items():
                stub = types.ModuleType(module)
                stub.__path__ = []
                for name in names:
                    setattr(stub, name, unavailable)
                sys.modules[module] = stub


def _point_at_cpu() -> None:
    """--device cpu: torchtitan's device helpers fall back to "cuda" when no accelerator is present; point
    them at the CPU (a dry run of its code path; float32, gloo)."""
    import torch
    from torchtitan.tools import utils

    class CPUModule:
        """torch.cuda's calls torchtitan makes, answered for the CPU: no memory statistics to report."""

        def get_device_name(self, *a):
            return "cpu"

        def get_device_properties(self, *a):
            return types.SimpleNamespace(total_memory=1 << 40, name="cpu")

        def memory_stats(self, *a):
            return {}

        def __getattr__(self, name):  # set_device, current_device, synchronize, empty_cache, reset_peak_...
            return lambda *a, **k: 0

    utils.device_type, utils.device_module = "cpu", CPUModule()
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type, module.device_module = "cpu", utils.device_module
    torch.distributed.Backend.default_device_backend_map.setdefault("cpu", "gloo")
    # torchtitan sets FSDP's gradient divide factor to 1 (it scales the loss itself), which reduce-scatters
    # with PREMUL_SUM, an op gloo lacks: on the CPU the gradients are averaged by FSDP as well (a dry run)
    from torch.distributed.fsdp import FSDPModule

    FSDPModule.set_gradient_divide_factor = lambda self, factor: None


def _shard_loader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **_):
    """torchtitan's data loader builder, reading lmyard's shard file (see the docstring)."""
    import numpy as np
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    sys.path.insert(0, str(REPO))
    from lmyard.data.shards import read_shard

    crc_dir = json.loads(os.environ.get("LMYARD_TITAN", "{}")).get("crc_dir")

    class ShardLoader(BaseDataLoader):
        def __init__(self):
            self.tokens = read_shard(job_config.training.dataset_path)
            self.T, self.B = job_config.training.seq_len, job_config.training.local_batch_size
            self.step = 0
            self.crc = BatchCrc(crc_dir, "torchtitan", dp_rank, job_config.training.steps)

        def __iter__(self):
            while True:
                first = (self.step * dp_world_size + dp_rank) * self.B * (self.T + 1)
                rows = np.asarray(self.tokens[first : first + self.B * (self.T + 1)], dtype=np.int64)
                self.crc.add(self.step, rows)
                rows = torch.from_numpy(rows).view(self.B, self.T + 1)
                self.step += 1
                yield {"input": rows[:, :-1]}, rows[:, 1:]

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state_dict):
            self.step = state_dict.get("step", 0)

    return ShardLoader()


class BatchCrc:
    """One rank's CRC-32 of the token rows it reads (int64, each step's (batch, seq + 1) in order): of step 0's,
    and running over steps 0 .. steps - 1, written to `<folder>/<side>-rank<r>.json` once the last step's rows
    are read; nothing without a folder. bench_titan_target.py checks both sides' batches with it."""

    def __init__(self, folder: str | None, side: str, rank: int, steps: int):
        self.folder, self.side, self.rank, self.steps = folder, side, rank, steps
        self.first, self.running = 0, 0

    def add(self, step: int, rows) -> None:
        import zlib

        import numpy as np

        if self.folder is None or step >= self.steps:
            return
        self.running = zlib.crc32(np.ascontiguousarray(rows, dtype=np.int64).tobytes(), self.running)
        self.first = self.running if step == 0 else self.first
        if step == self.steps - 1:
            out = {"side": self.side, "rank": self.rank, "step0": self.first, "all_steps": self.running}
            (Path(self.folder) / f"{self.side}-rank{self.rank}.json").write_text(
                json.dumps({**out, "steps": self.steps})
            )


def register(model: dict, flavor: str, attn: str) -> None:
    """Add lmyard's preset as a torchtitan llama3 flavor, and the llama3 TrainSpec reading lmyard's shard."""
    import dataclasses

    import torchtitan.models.llama3 as llama3
    from torchtitan.protocols.train_spec import register_train_spec

    llama3.llama3_args[flavor] = llama3.TransformerModelArgs(
        dim=model["n_embd"],
        n_layers=model["n_layer"],
        n_heads=model["n_head"],
        n_kv_heads=model["n_kv_head"],
        vocab_size=model["vocab_size"],
        multiple_of=model["multiple_of"],
        ffn_dim_multiplier=model["ffn_dim_multiplier"],
        norm_eps=model["norm_eps"],
        rope_theta=model["rope_theta"],
        attn_type=attn,
        attn_mask_type="causal" if attn == "sdpa" else "block_causal",
    )
    spec = dataclasses.replace(llama3.get_train_spec(), build_dataloader_fn=_shard_loader)
    register_train_spec("llama3", spec)  # user-registered specs come before torchtitan's own


def worker() -> None:
    """One rank: torchtitan's main with the flags after --worker (LMYARD_TITAN: the model and options)."""
    a = json.loads(os.environ["LMYARD_TITAN"])
    sys.argv = [sys.argv[0], *sys.argv[sys.argv.index("--worker") + 1 :]]  # before torchtitan.config is imported
    _stub_unused_imports()
    register(a["model"], a["flavor"], a["attn"])
    if a["device"] == "cpu":
        _point_at_cpu()
    from torchtitan.train import Trainer, main

    main(Trainer)


# ------------------------------------------------------------------ the launcher


def titan_settings(preset: str, seq: int, n_vocab: int = 50257) -> dict:
    """lmyard's model settings for `preset` (a vocabulary of its own, or GPT-2's padded to 64)."""
    sys.path.insert(0, str(REPO))
    from lmyard.config import ModelConfig
    from lmyard.models import llama

    d = llama.settings(ModelConfig(preset=preset, block_size=seq))
    d["vocab_size"] = d["vocab_size"] or 64 * -(-n_vocab // 64)
    return d


def titan_flags(a: argparse.Namespace, flavor: str, shard: Path, work: Path, options: dict | None = None) -> list[str]:
    """torchtitan 0.2.2's own command-line flags for this run; `options` ({flag: value}, None for a switch)
    replaces or adds flags (bench_titan_target.py: the schedule, the optimizer, the seed)."""
    flags: dict[str, object] = {
        "--model.name": "llama3",
        "--model.flavor": flavor,
        "--model.hf_assets_path": tokenizer_folder(work / "tokenizer"),
        "--job.dump_folder": work / "outputs",
        "--training.dataset": "lmyard_shard",
        "--training.dataset_path": shard,
        "--training.local_batch_size": a.batch,
        "--training.seq_len": a.seq,
        "--training.steps": a.steps,
        "--training.max_norm": "1.0",
        "--optimizer.lr": "3e-4",
        "--lr_scheduler.warmup_steps": "2",
        "--metrics.log_freq": a.log_freq,
        "--debug.seed": "0",
        "--activation_checkpoint.mode": a.ac,
        "--activation_checkpoint.selective_ac_option": "op",
    }
    if a.compile:
        flags.update({"--compile.enable": None, "--compile.components": "model,loss"})
    if a.float8 != "none":
        flags["--model.converters"] = "quantize.linear.float8"
        flags.update(
            {"--quantize.linear.float8.recipe_name": a.float8, "--quantize.linear.float8.filter_fqns": "output"}
        )
    # a dry run on the CPU: float32; float8 passes torchtitan's SM89 check only with `emulate` (which its recipes
    # then ignore: torch's CPU float8 matmul runs them)
    if a.device == "cpu":
        flags.update({"--optimizer.implementation": "foreach", "--training.mixed_precision_param": "float32"})
        flags.update({"--quantize.linear.float8.emulate": None} if a.float8 != "none" else {})
    flags.update(options or {})
    return [str(x) for flag, value in flags.items() for x in ((flag,) if value is None else (flag, value))]


def parse_log(out: str, warmup_logs: int) -> list[tuple[str, ...]]:
    """torchtitan's logged intervals after the first `warmup_logs`: (step, loss, GiB, tps, tflops, mfu%)."""
    logs = [m.groups() for m in map(STEP.search, ANSI.sub("", out).splitlines()) if m]
    return logs[warmup_logs:]


def launch(
    a: argparse.Namespace, gpus: int, shard: Path, options: dict | None = None, extra: dict | None = None
) -> str:
    """torchtitan on `gpus` GPUs (ranks, with --device cpu) reading `shard`: rank 0's whole output (appended to
    a.log too); SystemExit with its end where it failed. `options`: titan_flags'; `extra`: more worker settings
    (LMYARD_TITAN, e.g. crc_dir)."""
    flavor = f"lmyard-{a.preset}"
    work = Path(tempfile.mkdtemp(prefix="titan-"))
    settings = {"model": titan_settings(a.preset, a.seq), "flavor": flavor, "attn": a.attn, "device": a.device}
    env = {**os.environ, "LMYARD_TITAN": json.dumps({**settings, **(extra or {})}), "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as torchtitan's run_train.sh launches
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    torchrun += ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]  # rank 0's log: one line a step
    cmd = [*torchrun, str(Path(__file__).resolve()), "--worker", *titan_flags(a, flavor, shard, work, options)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if a.log:
        Path(a.log).open("a").write(out)
    if proc.returncode or not parse_log(out, 0):
        raise SystemExit(f"torchtitan run failed (rc {proc.returncode}):\n{ANSI.sub('', out)[-6000:]}")
    return out


def run(a: argparse.Namespace, gpus: int) -> dict:
    """One torchtitan run on `gpus` GPUs (ranks, with --device cpu) on the random-token shard; its figures."""
    shard = ensure_shards(a.data, (a.steps + 1) * a.batch * (a.seq + 1) * gpus)
    timed = parse_log(launch(a, gpus, shard), a.warmup_logs)
    if not timed:
        raise SystemExit(f"torchtitan logged no interval after the first {a.warmup_logs}")
    tps = statistics.median(float(t[3].replace(",", "")) for t in timed)
    return {
        "impl": f"torchtitan-{VERSION}",
        "preset": a.preset,
        "world": gpus,
        "B": a.batch,
        "T": a.seq,
        "ac": a.ac,
        "compile": a.compile,
        "float8": a.float8,
        "attn": a.attn,
        "tok_s": round(tps * gpus),
        "tok_s_per_gpu": round(tps),
        "mfu_titan": statistics.median(float(t[5]) for t in timed) / 100,
        "peak_reserved_gib": max(float(t[2]) for t in timed),
        "loss_last": float(timed[-1][1]),
        "intervals": len(timed),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1], help="GPU counts (ranks, with --device cpu)")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none", help="torchao recipe")
    ap.add_argument("--attn", default="sdpa", help="sdpa (lmyard's attention) or torchtitan's flex / varlen")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-freq", type=int, default=5, help="torchtitan's metrics.log_freq (steps)")
    ap.add_argument("--warmup-logs", type=int, default=2, help="logged intervals left out (compilation, warm-up)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "lmyard-bench-llama")
    ap.add_argument("--log", help="append torchtitan's whole output to this file")
    return ap


def main() -> None:
    if "--worker" in sys.argv:
        return worker()
    a = parser().parse_args()
    for gpus in a.gpus:
        print(json.dumps(run(a, gpus)), flush=True)


if __name__ == "__main__":
    main()
