"""Document masking (model.doc_mask): attention stays inside each packed document, for both families."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmyard.config import ModelConfig
from lmyard.data.shards import ShardSet
from lmyard.errors import UserError
from lmyard.models import attention
from lmyard.models.registry import build_model, model_from_spec, model_spec

EOT = 256  # the bytes tokenizer's <|endoftext|>
PRESETS = ["tiny", "llama-tiny"]


def _pair(preset: str, separators=(EOT, None)):
    """The same weights built with document masking and without."""
    torch.manual_seed(0)
    masked = build_model(ModelConfig(preset=preset, doc_mask=True), 257, separators).eval()
    causal = build_model(ModelConfig(preset=preset), 257).eval()
    causal.load_state_dict(masked.state_dict())
    return masked, causal


def _packed(T: int = 48, split: int = 20, seed: int = 1) -> torch.Tensor:
    """Two sequences of [EOT doc A, EOT doc B], doc B starting at `split`."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (2, T), generator=g)
    idx[:, 0] = idx[:, split] = EOT
    return idx


def test_document_ids_begin_at_the_bos_and_end_after_the_eos():
    idx = torch.tensor([[7, 9, 1, 5, 1, 1, 8]])
    assert attention.document_ids(idx, 1, None).tolist() == [[0, 0, 1, 1, 2, 3, 3]]
    assert attention.document_ids(idx, None, 1).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_packed_document_sees_nothing_of_the_document_before_it(preset):
    masked, causal = _pair(preset)
    packed = _packed()
    other = packed.clone()
    other[:, 1:20] = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(2))  # another doc A
    with torch.no_grad():
        a, b = masked(packed), masked(other)
        torch.testing.assert_close(a[:, 20:], b[:, 20:], rtol=0, atol=1e-5)  # doc B alone at the same positions
        assert (a[:, 1:20] - b[:, 1:20]).abs().max() > 1e-2  # doc A's own outputs did change
        assert (causal(packed)[:, 20:] - causal(other)[:, 20:]).abs().max() > 1e-3  # causal attention crosses


@pytest.mark.parametrize("preset", PRESETS)
def test_without_a_separator_inside_the_sequence_it_is_causal_attention(preset):
    masked, causal = _pair(preset)
    idx = _packed()
    idx[:, 20] = 3  # one document, begun at position 0
    with torch.no_grad():
        torch.testing.assert_close(masked(idx), causal(idx), rtol=1e-5, atol=1e-5)
    loss = masked(idx, idx)  # and it trains (CPU: the dense mask has a backward)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in masked.parameters())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("gqa", [False, True])
def test_flex_attention_block_mask_equals_the_dense_block_causal_mask(gqa):
    g = torch.Generator().manual_seed(0)
    docs = attention.document_ids(_packed(T=200, split=77), EOT, None)  # tiles of 128 across a boundary
    q = torch.randn(2, 4, 200, 16, generator=g)
    k, v = (torch.randn(2, 2 if gqa else 4, 200, 16, generator=g) for _ in range(2))
    with torch.no_grad():  # FlexAttention has no backward on CPU
        flex = attention.attend(q, k, v, attention.block_mask(docs), enable_gqa=gqa)
    dense = attention.attend(q, k, v, attention.dense_mask(docs), enable_gqa=gqa)
    reference = torch.ones(200, 200, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=reference[:, None], enable_gqa=gqa)
    torch.testing.assert_close(flex, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, expected, rtol=0, atol=0)


def test_end_of_document_separators_mask_the_same_way():
    masked, _ = _pair("tiny", separators=(None, EOT))
    packed = _packed()
    packed[:, 0], packed[:, 20], packed[:, 19] = 5, 5, EOT  # doc A ends with EOT at 19; doc B starts at 20
    other = packed.clone()
    other[:, :19] = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(masked(packed)[:, 20:], masked(other)[:, 20:], rtol=0, atol=1e-5)


def test_the_mask_is_recorded_in_the_model_spec_and_rebuilt_from_it():
    masked, causal = _pair("llama-tiny")
    assert model_spec(masked)["doc_bos"] == EOT and model_spec(causal)["doc_bos"] is None
    assert model_from_spec(model_spec(masked)).config == masked.config


def test_shard_set_separators_follow_the_manifest_tokenizer():
    def sep(tokenizer):
        return ShardSet(address="a", uri="u", manifest={"tokenizer": tokenizer, "shards": []}).separators

    assert sep({"name": "bytes", "n_vocab": 257, "eot": 256}) == (256, None)  # <|endoftext|> before each
    assert sep({"name": "r50k_base", "eot": 50256, "bos": None, "eos": 50256}) == (None, 50256)
    assert sep({"name": "tokenizer.json:x", "bos": 1, "eos": 2}) == (1, 2)


def test_doc_mask_refuses_an_sdpa_kernel_attention_dropout_and_unseparated_documents():
    with pytest.raises(ValueError, match="leave model.attention=auto"):
        ModelConfig(preset="tiny", doc_mask=True, attention="flash")
    with pytest.raises(ValueError, match="set model.dropout=0"):
        ModelConfig(preset="tiny", doc_mask=True, dropout=0.1)
    with pytest.raises(UserError, match="set tokenizer.bos or tokenizer.eos"):
        build_model(ModelConfig(preset="tiny", doc_mask=True), 257, (None, None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's fused kernel runs on CUDA")
@pytest.mark.parametrize("preset", PRESETS)
def test_on_cuda_flex_attention_eager_and_compiled_match_the_dense_mask_on_cpu(preset):
    """The GPU path (BlockMask, compiled flex_attention; inside a compiled model too): its loss and gradients are
    the CPU dense mask's. TF32 may round the kernel's matmuls: loose tolerances."""
    masked, _ = _pair(preset)
    idx = _packed(T=64, split=23)
    loss = masked(idx, idx)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in masked.named_parameters()}
    on_gpu = masked.cuda()
    for model in (on_gpu, torch.compile(on_gpu)):
        on_gpu.zero_grad(set_to_none=True)
        got = model(idx.cuda(), idx.cuda())
        got.backward()
        torch.testing.assert_close(got.cpu(), loss.detach(), rtol=2e-3, atol=2e-3)
        for n, p in on_gpu.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), expected[n], rtol=2e-2, atol=2e-3, msg=n)
