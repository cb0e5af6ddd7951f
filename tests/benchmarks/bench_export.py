"""Time `lmyard export` of a GPT-2 124M checkpoint (random weights) and its load in transformers.

    python tests/benchmarks/bench_export.py [--dir /tmp/bench-export]

Needs TIKTOKEN_CACHE_DIR (GPT-2's ranks, offline) and transformers. Prints seconds per phase.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from lmyard.run import Run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/bench-export")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    from lmyard.checkpoint.full import FullCheckpointer
    from lmyard.export import hf as export
    from lmyard.layout import RunLayout
    from lmyard.models.gpt2.model import GPT, GPTConfig
    from lmyard.recipes import load_recipe
    from lmyard.store import open_store

    cfg = load_recipe("smoke", ["tokenizer.name=gpt2", "model.preset=gpt2-124m"])
    gcfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model = GPT(gcfg)
    state = {"step": 1, "tokens_seen": 0, "config": cfg.model_dump(mode="json"), "model": gcfg.__dict__}
    t0 = time.perf_counter()
    store = open_store(f"{args.dir}/store")
    writer = FullCheckpointer(Run("bench", store), f"{args.dir}/staging", say=lambda s: None)
    writer.save(model, None, state, [])
    writer.close()
    uri = store.uri(RunLayout("bench").step(1))
    t1 = time.perf_counter()
    export.export(uri, f"{args.dir}/hf", cache_dir=f"{args.dir}/cache")
    t2 = time.perf_counter()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(f"{args.dir}/hf")
    t3 = time.perf_counter()
    ids = torch.randint(0, 50257, (1, 256))
    with torch.no_grad():
        diff = (hf(ids).logits - model.eval()(ids)).abs().max().item()
    size = os.path.getsize(f"{args.dir}/hf/model.safetensors") / 1e6
    print(
        f"GPT-2 124M: checkpoint save {t1 - t0:.1f} s; export {t2 - t1:.1f} s ({size:.0f} MB safetensors); "
        f"transformers load {t3 - t2:.1f} s; max |logit diff| {diff:.2e} on 256 tokens"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
