"""torchtitan 0.3.0's Llama 3 trainer on lmyard's shape and tokens: the peer of bench_llama.py.

    python tests/benchmarks/run_torchtitan.py --gpus 4 --preset llama-1b --seq 2048 --batch 4 --ac none --compile

It writes a local tokenizer folder (a 3-entry WordLevel vocab.json and tokenizer_config.json: the
tokens come already tokenized, torchtitan only needs to load one), makes the random-token shard
bench_llama.py reads (tests/benchmarks/random_shards.py) when missing, then runs
`torchrun ... run_torchtitan.py --worker`, which starts torchtitan's own entry point
(torchtitan.train.main) with `--module run_torchtitan --config lmyard_bench`: a Trainer.Config built here with

- the model: torchtitan's Llama3Model built from its own config helpers (its initialisation, fused qkv,
  RMSNorm, SwiGLU, RoPE theta 500000 with Llama scaling, as its 1B/8B flavors) at lmyard's preset's
  dimensions, untied embeddings (lmyard's Llama is untied; torchtitan's 1B flavor ties them), and
  F.scaled_dot_product_attention with is_causal (lmyard's attention; torchtitan's default is FlexAttention
  with per-document masks: `--attn flex` runs that instead);
- its parallelize_llama: activation checkpointing (SelectiveAC = its op-level policy, FullAC), per-block
  torch.compile (model and loss), FSDP2 with bf16 parameters and fp32 reduction, on its `partial_dtensor`
  backend (FSDP2 over a data-parallel mesh, as lmyard; its default `spmd_types` backend passes
  fully_shard a `dp_mesh_dims` argument that torch 2.11 does not have);
- its chunked cross-entropy loss, AdamW (fused), warmup + decay schedule; checkpoints and validation off;
- its default CUDA graph of the forward + backward (`training.disable_cuda_graphs` false); should that
  capture fail under torch 2.11, the run is made again without it and the JSON says `"cuda_graphs": false`;
- a data loader reading the same shard file lmyard reads: rank r, step s takes sequences
  (s * world + r) * batch ... + batch of seq + 1 tokens, as bench_llama.py does.

On the GPU machine (torch 2.11) three names torchtitan 0.3.0 uses do not exist yet (nor in torch 2.13):
torch.distributed.fsdp.DataParallelMeshDims and ..._fsdp_common.ShardPlacementResult, imported at module
level and used only by its full-DTensor and expert-parallel paths, get placeholders; and
torch.distributed.set_timeout, with which it shortens the collectives' timeout after the first step,
becomes a no-op (the timeout stays torch's default). torch.utils.tensorboard and `datasets` are stubbed when missing
(torchtitan imports them at module level; this run logs no tensorboard and reads no HF dataset). Prints one JSON line: tokens/s per GPU (torchtitan's `tps`, median
of the logged steps after warm-up), tokens/s, MFU (torchtitan's own and lmyard's formula), peak memory.
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
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.]+).*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+)%"
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


def _shim_torch() -> None:
    """Placeholders for the FSDP2 names torchtitan 0.3.0 imports that torch 2.11 lacks, and for the packages it
    imports but this run does not use (see the docstring)."""
    import dataclasses

    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    if not hasattr(dist, "set_timeout"):  # after step 1 torchtitan shortens its collectives' timeout: kept as is
        dist.set_timeout = lambda timeout, group=None: None

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass
        class DataParallelMeshDims:  # only constructed on torchtitan's full_dtensor path
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
    if not hasattr(_fsdp_common, "ShardPlacementResult"):

        @dataclasses.dataclass
        class ShardPlacementResult:  # only used for expert parallelism
            placement: object = None
            mesh_info: object = None

        _fsdp_common.ShardPlacementResult = ShardPlacementResult

    def unavailable(*a, **k):
        raise RuntimeError("not installed: this benchmark reads lmyard's shard file, without tensorboard")

    stubs = {
        "tensorboard": {"torch.utils.tensorboard": ["SummaryWriter"]},
        "datasets": {
            "datasets": ["Dataset", "load_dataset", "IterableDataset"],
            "datasets.distributed": ["split_dataset_by_node"],
        },
    }
    for package, modules in stubs.items():
        try:
            __import__(package)
        except ImportError:  # imported by modules this run does not use (tensorboard logging, HF datasets)
            for module, names in modules.items():
                stub = types.ModuleType(module)
                stub.__path__ = []
                for name in names:
                    setattr(stub, name, unavailable)
                sys.modules[module] = stub


def _shard_loader_class():
    from dataclasses import dataclass

    import numpy as np
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class ShardLoader(BaseDataLoader):
        """lmyard's shard file, sequence by sequence: rank r of w, step s takes sequences (s*w + r)*B ..."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, seq_len, local_batch_size, **_):
            sys.path.insert(0, str(REPO))
            from lmyard.data.shards import read_shard

            self.tokens, self.T, self.B = read_shard(config.dataset_path), seq_len, local_batch_size
            self.rank, self.world, self.step = dp_rank, dp_world_size, 0

        def __iter__(self):
            while True:
                first = (self.step * self.world + self.rank) * self.B * (self.T + 1)
                rows = np.asarray(self.tokens[first : first + self.B * (self.T + 1)], dtype=np.int64)
                rows = torch.from_numpy(rows).view(self.B, self.T + 1)
                self.step += 1
                yield {"input": rows[:, :-1]}, rows[:, 1:]

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state):
            self.step = state.get("step", 0)

    return ShardLoader


def _layers(m: dict, attn: str):
    from torchtitan.models.common import ComplexRoPE, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import _LINEAR_INIT, _NORM_INIT, _depth_init
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    dim, heads = m["n_embd"], m["n_head"]
    hidden = compute_ffn_hidden_dim(dim, multiple_of=m["multiple_of"], ffn_dim_multiplier=m["ffn_dim_multiplier"])
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=m["block_size"], theta=m["rope_theta"], scaling="llama")
    inner = ScaledDotProductAttention.Config() if attn == "sdpa" else get_attention_config(attn)
    return [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=m["n_kv_head"],
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_depth_init(i),
                inner_attention=inner,
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hidden, w1_param_init=_LINEAR_INIT, w2w3_param_init=_depth_init(i)
            ),
        )
        for i in range(m["n_layer"])
    ]


def lmyard_bench():
    """The Trainer.Config of this benchmark (read by torchtitan's ConfigManager: --config lmyard_bench)."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, parallelize_llama
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    a = json.loads(os.environ["LMYARD_TITAN"])
    m, dim, V = a["model"], a["model"]["n_embd"], a["model"]["vocab_size"]
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=V,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=V, param_init=_output_linear_init(dim)),
        layers=_layers(m, a["attn"]),
    )
    spec = ModelSpec(
        name="llama3",
        flavor="lmyard",
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
    ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[a["ac"]]
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=V)),
        hf_assets_path=a["tokenizer"],
        dump_folder=a["dump"],
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=a["batch"], seq_len=a["seq"], steps=a["steps"], disable_cuda_graphs=not a["cuda_graphs"]
        ),
        dataloader=_shard_loader_class().Config(dataset_path=a["shard"]),
        metrics=MetricsProcessor.Config(log_freq=a["log_freq"]),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=a["compile"], components=["model", "loss"]),
        validator=Validator.Config(enable=False),
    )


def worker() -> None:
    _shim_torch()
    from torchtitan.train import main

    sys.path.insert(0, str(HERE))  # torchtitan imports the config function from this file as a module
    sys.argv = [sys.argv[0], "--module", "run_torchtitan", "--config", "lmyard_bench"]
    main()


# ------------------------------------------------------------------ the launcher


def titan_settings(preset: str, seq: int, n_vocab: int = 50257) -> dict:
    sys.path.insert(0, str(REPO))
    from lmyard.config import ModelConfig
    from lmyard.models import llama

    d = llama.settings(ModelConfig(preset=preset, block_size=seq))
    d["vocab_size"] = d["vocab_size"] or 64 * -(-n_vocab // 64)
    return d


def run(
    gpus: int,
    preset: str,
    seq: int,
    batch: int,
    ac: str,
    compile: bool,
    steps: int,
    warmup_logs: int,
    data_dir: Path,
    attn: str = "sdpa",
    log_freq: int = 5,
    cuda_graphs: bool = True,
) -> dict:
    """One torchtitan run on `gpus` GPUs; its parsed figures. With `cuda_graphs` (torchtitan's default: the
    forward + backward captured in a CUDA graph) a failed run is tried once more without them."""
    m = titan_settings(preset, seq)
    shard = ensure_shards(data_dir, (steps + 1) * batch * (seq + 1) * gpus)
    work = Path(tempfile.mkdtemp(prefix="titan-"))
    settings = {
        "model": m,
        "attn": attn,
        "ac": ac,
        "compile": compile,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "log_freq": log_freq,
        "shard": str(shard),
        "tokenizer": str(tokenizer_folder(work / "tokenizer")),
        "dump": str(work / "outputs"),
        "cuda_graphs": cuda_graphs,
    }
    env = {**os.environ, "LMYARD_TITAN": json.dumps(settings), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        str(Path(__file__).resolve()),
        "--worker",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = ANSI.sub("", proc.stdout + proc.stderr)
    logs = [m_.groups() for m_ in map(STEP.search, out.splitlines()) if m_]
    if proc.returncode or len(logs) <= warmup_logs:
        if cuda_graphs:
            print(
                f"torchtitan with CUDA graphs failed (rc {proc.returncode}); again without them. Its last lines:\n"
                + "\n".join(out.splitlines()[-15:]),
                file=sys.stderr,
                flush=True,
            )
            return run(gpus, preset, seq, batch, ac, compile, steps, warmup_logs, data_dir, attn, log_freq, False)
        raise SystemExit(f"torchtitan run failed (rc {proc.returncode}):\n{out[-6000:]}")
    timed = logs[warmup_logs:]
    tps = statistics.median(float(t[3].replace(",", "")) for t in timed)
    return {
        "impl": "torchtitan-0.3.0",
        "world": gpus,
        "B": batch,
        "T": seq,
        "ac": ac,
        "compile": compile,
        "attn": attn,
        "cuda_graphs": cuda_graphs,
        "tok_s": round(tps * gpus),
        "tok_s_per_gpu": round(tps),
        "mfu_titan": statistics.median(float(t[5]) for t in timed) / 100,
        "peak_reserved_gib": max(float(t[2]) for t in timed),
        "loss_last": float(timed[-1][1]),
        "intervals": len(timed),
    }


def main() -> None:
    if "--worker" in sys.argv:
        return worker()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--attn", default="sdpa", help="sdpa (lmyard's attention) or torchtitan's flex / varlen")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="torchtitan's training.disable_cuda_graphs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-logs", type=int, default=2, help="logged intervals (of 5 steps) left out")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "lmyard-bench-llama")
    a = ap.parse_args()
    for g in a.gpus:
        print(
            json.dumps(
                run(
                    g,
                    a.preset,
                    a.seq,
                    a.batch,
                    a.ac,
                    a.compile,
                    a.steps,
                    a.warmup_logs,
                    a.data,
                    a.attn,
                    cuda_graphs=not a.no_cuda_graphs,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
