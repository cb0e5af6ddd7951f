"""lmyard's own Triton kernels compiled ahead of the first step (lmyard.train.kernel_warmup): what the child is
given, that nothing starts without CUDA, and on a GPU that a Llama training step then compiles none of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lmyard.models.gpt2.model import GPTConfig
from lmyard.models.llama.model import LlamaConfig
from lmyard.train import kernel_warmup

LLAMA = LlamaConfig(vocab_size=512, block_size=64, n_layer=1, n_head=4, n_embd=64, n_kv_head=2, ffn_hidden=128)

# one training step and one evaluation of LLAMA, eager, under the step's autocast, with lmyard's AdamW and clip
STEP = """
import torch
from lmyard.models.llama.model import Llama, LlamaConfig
from lmyard.train.distributed.parallelism import ComputeContext
from lmyard.train.optim import AdamW, clipped_update
model = Llama(LlamaConfig(**{config})).cuda()
idx = torch.randint(0, 512, (2, 64), device="cuda")
with ComputeContext(True, "auto"):
    model(idx, idx).backward()
    with torch.no_grad():
        model(idx, idx)
params = list(model.parameters())
clipped_update(params, AdamW(model.param_groups(0.1), lr=1e-3, fused=True), 1.0)
torch.cuda.synchronize()
"""


def test_the_child_is_given_the_vocabulary_and_for_llama_the_heads_and_length_of_rope():
    gpt2 = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert kernel_warmup.shapes(gpt2) == {"vocab": 50304, "rope": None}
    assert kernel_warmup.shapes(LLAMA) == {"vocab": 512, "rope": [4, 2, 16, 64]}


def test_nothing_starts_on_the_cpu_or_on_a_nodes_other_ranks():
    with kernel_warmup.started(LLAMA, torch.device("cpu"), 0) as child:
        assert child is None
    with kernel_warmup.started(LLAMA, torch.device("cuda", 1), 1) as child:
        assert child is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_after_the_child_a_llama_training_step_compiles_none_of_lmyards_kernels(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    given = json.dumps({**kernel_warmup.shapes(LLAMA), "device": 0})
    subprocess.run([sys.executable, "-m", "lmyard.train.kernel_warmup", given], env=env, check=True, timeout=600)
    warmed = set(os.listdir(tmp_path / "triton"))
    assert warmed
    config = {k: getattr(LLAMA, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    step = STEP.format(config={**config, "n_kv_head": 2, "ffn_hidden": 128})
    subprocess.run([sys.executable, "-c", step], env=env, check=True, timeout=600)
    assert set(os.listdir(tmp_path / "triton")) == warmed  # each kernel the step launched was in the cache
