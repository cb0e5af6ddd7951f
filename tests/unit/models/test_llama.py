"""The Llama model, its config and presets, activation checkpointing, and memory planning (the checkpointed
blocks trained and compiled: tests/integration/test_llama_integration.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from llama_helpers import _tiny

from lmyard.config import ModelConfig, TrainConfig
from lmyard.errors import UserError
from lmyard.models import registry
from lmyard.models.gpt2.model import GPT
from lmyard.models.llama import ffn_hidden_size
from lmyard.models.llama.model import Llama, LlamaConfig
from lmyard.models.registry import build_model, flops_per_token, model_config, model_from_spec, model_spec
from lmyard.recipes import load_recipe
from lmyard.train.distributed import Dist, plan_memory
from lmyard.train.distributed.memory import check, describe, estimate, resolve
from lmyard.train.distributed.parallel import apply_activation_checkpointing, compile_blocks
from lmyard.train.distributed.parallelism import prepare_model

GB80 = 80 * 10**9


def test_forward_gives_logits_and_the_loss_is_the_cross_entropy_of_those_logits():
    model = _tiny()
    x, y = torch.randint(0, 257, (3, 64)), torch.randint(0, 257, (3, 64))
    logits = model(x)
    assert logits.shape == (3, 64, 320)
    loss = model(x, y)
    assert loss.shape == ()
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, 320), y.view(-1)), atol=1e-5)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_grouped_query_attention_equals_attention_with_the_kv_heads_repeated():
    """4 query heads on 2 kv heads == 4-head attention whose k and v projections repeat each kv head."""
    gqa = _tiny()
    c = gqa.config
    mha = Llama(LlamaConfig(**{**c.__dict__, "n_kv_head": c.n_head}))
    state = gqa.state_dict()
    rep = c.n_head // c.n_kv_head
    for i in range(c.n_layer):
        w = state[f"layers.{i}.self_attn.qkv_proj.weight"]
        q, k, v = w.split(gqa.layers[i].self_attn.sizes)
        k, v = (t.view(c.n_kv_head, c.head_dim, -1).repeat_interleave(rep, 0).reshape(-1, c.n_embd) for t in (k, v))
        state[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat((q, k, v))
    mha.load_state_dict(state)
    x = torch.randint(0, 257, (2, 64))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


def test_attention_is_causal_and_rope_makes_it_position_aware():
    model = _tiny().eval()
    x = torch.randint(0, 257, (1, 64))
    y = x.clone()
    y[0, 40:] = (y[0, 40:] + 1) % 257
    a, b = model(x), model(y)
    assert torch.allclose(a[0, :40], b[0, :40], atol=1e-5) and not torch.allclose(a[0, 40:], b[0, 40:])
    # attention alone: without positions its last output would not depend on the order of the earlier tokens
    attn = model.layers[0].self_attn
    h = torch.randn(1, 5, model.config.n_embd)
    swapped = h[:, [2, 1, 0, 3, 4]]
    cos, sin = model.rope_cos[:5], model.rope_sin[:5]
    no_rope = torch.ones_like(cos), torch.zeros_like(sin)
    with_rope = (attn(h, cos, sin)[0, -1] - attn(swapped, cos, sin)[0, -1]).abs().max()
    without = (attn(h, *no_rope)[0, -1] - attn(swapped, *no_rope)[0, -1]).abs().max()
    assert with_rope > 1000 * without and with_rope > 1e-5


def test_presets_have_the_published_llama_shapes():
    def shape(preset):
        with torch.device("meta"):
            m = build_model(ModelConfig(preset=preset), 50257)
        return m.config, m.num_params()

    c1, n1 = shape("llama-1b")
    assert (c1.n_layer, c1.n_embd, c1.n_head, c1.n_kv_head, c1.ffn_hidden, c1.vocab_size) == (
        16,
        2048,
        32,
        8,
        8192,
        128256,
    )
    assert n1 == 1_235_814_400 + 128256 * 2048  # Llama-3.2-1B (tied) plus an untied head
    c8, n8 = shape("llama-8b")
    assert (c8.n_layer, c8.n_embd, c8.n_kv_head, c8.ffn_hidden, c8.rope_theta) == (32, 4096, 8, 14336, 500000.0)
    assert n8 == 8_030_261_248  # Llama-3-8B
    c3, _ = shape("llama-3b")
    assert (c3.n_layer, c3.n_embd, c3.n_head, c3.ffn_hidden) == (28, 3072, 24, 8192)
    assert ffn_hidden_size(4096, 1024, 1.3) == 14336 and ffn_hidden_size(768, 256, None) == 2048


def test_flops_per_token_is_torchtitans_formula():
    model = _tiny()
    c = model.config
    n_matmul = model.num_params() - c.vocab_size * c.n_embd  # all but the input embedding table
    assert flops_per_token(model_spec(model)) == 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.block_size


def test_build_model_picks_the_architecture_and_the_spec_rebuilds_it():
    assert isinstance(build_model(ModelConfig(preset="tiny"), 257), GPT)
    llama = _tiny()
    assert (
        "lm_head.weight" in llama.state_dict()
        and llama.lm_head.weight.data_ptr() != llama.embed_tokens.weight.data_ptr()
    )
    again = model_from_spec(model_spec(llama))
    assert isinstance(again, Llama) and again.config == llama.config
    assert isinstance(
        model_from_spec({"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8}), GPT
    )


def test_config_rejects_llama_fields_on_gpt2_and_mismatched_arch():
    with pytest.raises(UserError, match="apply to llama models only"):
        load_recipe("smoke", ["model.n_kv_head=2"])
    with pytest.raises(UserError, match="model.arch is gpt2 but model.preset llama-1b"):
        load_recipe("smoke", ["model.preset=llama-1b", "model.arch=gpt2"])
    with pytest.raises(UserError, match="multiple of model.n_kv_head"):
        load_recipe("smoke", ["model.preset=llama-tiny", "model.n_kv_head=3"])
    cfg = load_recipe(
        "smoke",
        [
            "model.preset=null",
            "model.arch=llama",
            "model.n_layer=2",
            "model.n_head=4",
            "model.n_embd=64",
            "model.block_size=32",
        ],
    )
    assert cfg.model.architecture() == "llama" and model_config(cfg.model, 257).n_kv_head == 4


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_activation_checkpointing_changes_no_loss_or_gradient(mode):
    x, y = torch.randint(0, 257, (2, 64)), torch.randint(0, 257, (2, 64))
    ref = _tiny()
    ref(x, y).backward()
    model = _tiny()
    apply_activation_checkpointing(model, mode)
    assert set(model.state_dict()) == set(ref.state_dict())  # checkpoints stay loadable either way
    loss = model(x, y)
    loss.backward()
    assert torch.allclose(loss, ref(x, y), atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6), name


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_ddp_path_checkpoints_the_configured_blocks(mode):
    """train.parallel=ddp applies activation checkpointing too (it used to be planned for, not applied)."""
    cfg = load_recipe("smoke", ["model.preset=llama-tiny", f"train.activation_checkpointing={mode}"])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing_blocks": 1})})
    model = _tiny()
    prepare_model(model, cfg, Dist(0, 0, 1, torch.device("cpu")))
    assert [type(b).__name__ for b in model.layers] == ["CheckpointWrapper", "Block"]


def test_ddp_path_takes_train_float8_too():
    """train.float8 under train.parallel=ddp (one GPU's plain path) goes through the float8 conversion, as under
    fsdp: on a CPU it is skipped with its warning, where before it was silently ignored."""
    overrides = [
        "model.preset=llama-tiny",
        "train.parallel=ddp",
        "train.float8=true",
        "train.activation_checkpointing=none",
    ]
    cfg = load_recipe("smoke", overrides)
    with pytest.warns(UserWarning, match="train.float8 skipped: float8 matmuls need a CUDA GPU"):
        prepare_model(_tiny(), cfg, Dist(0, 0, 1, torch.device("cpu")))


def test_compiled_blocks_keep_their_parameter_names():
    model = _tiny()
    names = set(model.state_dict())
    compile_blocks(model)
    assert set(model.state_dict()) == names


def _plan(preset, world, parallel, ac="none", micro_batch=1, device_bytes=GB80, **train):
    t = TrainConfig(parallel=parallel, activation_checkpointing=ac, micro_batch=micro_batch, **train)
    return estimate(ModelConfig(preset=preset), t, world, device_bytes)


def test_8b_with_ddp_on_80gb_is_refused_naming_fsdp():
    plan = _plan("llama-8b", 4, "ddp", ac="full")
    assert plan.params + plan.grads + plan.optimizer == 16 * 8_030_261_248
    with pytest.raises(UserError, match=r"will not fit: .* it would fit with train\.parallel=fsdp"):
        check(plan)


def test_8b_on_four_80gb_gpus_keeps_every_activation_compiled_but_not_eager_or_accumulating():
    """Compiled blocks keep fewer activations (the family's `compiled` figure), and under fsdp without
    accumulation the gradients are made as the activations are freed: Llama-3 8B at seq 8192 then fits
    with no checkpointing. Eager, or with a second micro-step, it does not, and the error names checkpointing."""
    one_step = 8192 * 4  # micro_batch 1 x 8192 tokens x 4 GPUs: one micro-step per optimizer step
    assert check(_plan("llama-8b", 4, "fsdp", ac="full")).fits
    assert check(_plan("llama-8b", 4, "fsdp", batch_tokens=one_step)).fits
    for other in ({"compile": False, "batch_tokens": one_step}, {"batch_tokens": 2 * one_step}):
        with pytest.raises(UserError, match=r"train\.activation_checkpointing=(pointwise|selective|full)"):
            check(_plan("llama-8b", 4, "fsdp", **other))


def test_fsdp_gradients_count_at_the_activation_peak_only_when_micro_steps_accumulate():
    alone = _plan("llama-1b", 4, "fsdp", batch_tokens=2048 * 4)  # one micro-step of 2048 tokens on each of 4 GPUs
    accumulating = _plan("llama-1b", 4, "fsdp", batch_tokens=2 * 2048 * 4)
    static = alone.params + alone.optimizer + alone.working
    assert alone.total == static + max(alone.grads, alone.activations)
    assert accumulating.total == static + alone.grads + alone.activations
    assert "grads 1.4 made as the activations are freed" in alone.summary()
    ddp = _plan("llama-1b", 1, "ddp", batch_tokens=2048)  # DDP's gradient buckets stay allocated
    assert ddp.total == ddp.params + ddp.grads + ddp.optimizer + ddp.working + ddp.activations


def test_bf16_shards_are_planned_with_float32_masters_in_the_optimizer_and_bf16_gradients():
    n, one_step = 8_030_261_248, 8192 * 4
    f32 = _plan("llama-8b", 4, "fsdp", batch_tokens=one_step)
    bf16 = _plan("llama-8b", 4, "fsdp", batch_tokens=one_step, fsdp_param_dtype="bfloat16")
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * n // 4, 2 * n // 4, 12 * n // 4)
    assert bf16.params + bf16.grads + bf16.optimizer == f32.params + f32.grads + f32.optimizer
    ddp = _plan("llama-1b", 1, "ddp", fsdp_param_dtype="bfloat16")  # an fsdp setting: ddp keeps float32
    assert ddp.params == _plan("llama-1b", 1, "ddp").params


def test_compiled_blocks_are_planned_with_the_family_s_compiled_figure_where_it_has_one():
    per_token = registry.spec("llama").terms(registry.resolve(ModelConfig(preset="llama-1b"), 50257))
    compiled, eager = _plan("llama-1b", 1, "fsdp"), _plan("llama-1b", 1, "fsdp", compile=False)
    assert eager.activations - compiled.activations == 2048 * 16 * (
        per_token.activations["none"] - per_token.compiled["none"]
    )
    assert (
        _plan("llama-1b", 1, "fsdp", ac="selective").activations
        == _plan("llama-1b", 1, "fsdp", ac="selective", compile=False).activations
    )  # no compiled figure for selective: the same
    pointwise = [_plan("llama-1b", 1, "fsdp", ac="pointwise", compile=c).activations for c in (False, None)]
    assert pointwise[0] - pointwise[1] == 2048 * 16 * (
        per_token.activations["pointwise"] - per_token.compiled["pointwise"]
    )


def test_planning_error_names_a_smaller_micro_batch_and_more_gpus():
    with pytest.raises(UserError, match=r"train\.micro_batch=\d+ "):
        check(_plan("llama-1b", 1, "fsdp", ac="full", micro_batch=64))
    with pytest.raises(UserError, match=r"\d+ GPUs"):
        check(_plan("llama-8b", 1, "fsdp", ac="full"))


def test_sharding_divides_the_static_memory_by_the_ranks():
    one, four = _plan("llama-1b", 1, "fsdp"), _plan("llama-1b", 4, "fsdp")
    assert four.optimizer * 4 == pytest.approx(one.optimizer, rel=1e-6)
    assert four.activations == one.activations
    assert (
        _plan("llama-1b", 1, "fsdp", ac="full").activations
        < _plan("llama-1b", 1, "fsdp", ac="selective").activations
        < _plan("llama-1b", 1, "fsdp", ac="pointwise").activations
        < one.activations
    )
    assert math.isclose(check(_plan("gpt2-124m", 1, "ddp", micro_batch=32)).params, 4 * 124_475_904, rel_tol=0.01)


def test_float8_is_skipped_with_a_warning_where_the_device_has_no_float8_matmuls():
    from lmyard.train.distributed.parallel import apply_float8

    model = _tiny()
    with pytest.warns(UserWarning, match="train.float8 skipped"):
        assert apply_float8(model, torch.device("cpu")) is False
    assert not any("Float8" in type(m).__name__ for m in model.modules())


def _wide_llama(n_layer: int) -> ModelConfig:
    """Llama-8B's width and sequence (4096, 8192 tokens) at n_layer blocks."""
    return ModelConfig(preset=None, arch="llama", n_layer=n_layer, n_head=32, n_embd=4096, block_size=8192)


@pytest.mark.parametrize(
    "n_layer, batch_tokens, chosen",
    [
        (16, 4096, "none"),
        (42, 4096, "pointwise on 21 of 42 blocks"),
        (50, 4096, "selective on 39 of 50 blocks"),
        (55, 4096, "selective"),
        (60, 4096, "full on 37 of 60 blocks"),
        (73, 2 * 4 * 8192, "full on all 73 blocks"),  # two micro-steps: the gradients count at the peak
    ],
)
def test_auto_checkpointing_is_the_lightest_that_fits_as_the_model_grows(n_layer, batch_tokens, chosen):
    """On four 80 GB GPUs under fsdp: none while it fits, then pointwise on the fewest first blocks, then
    selective on the fewest first blocks (once pointwise everywhere no longer fits), then selective everywhere,
    then full on the fewest first blocks, then full everywhere; what auto chose fits, and the next lighter
    setting does not."""
    model, auto = _wide_llama(n_layer), TrainConfig(parallel="fsdp", micro_batch=1, batch_tokens=batch_tokens)
    train, line = resolve(model, auto, 4, GB80)
    assert describe(train, n_layer) == chosen
    assert line is not None and line.startswith(f"activation checkpointing: {chosen} (plan ")
    assert check(estimate(model, train, 4, GB80)).fits
    assert estimate(model, auto, 4, GB80).train_cfg == train  # a plan of `auto` is the plan of what it chooses
    n = train.activation_checkpointing_blocks or n_layer
    lighter = {
        "none": [],
        "pointwise on 21 of 42 blocks": [("none", None), ("pointwise", n - 1)],
        "selective on 39 of 50 blocks": [("pointwise", None), ("selective", n - 1)],
        "selective": [("pointwise", None), ("selective", n - 1)],
        "full on 37 of 60 blocks": [("selective", None), ("full", n - 1)],
        "full on all 73 blocks": [("selective", None), ("full", n - 1)],
    }[chosen]
    for ac, blocks in lighter:
        update = {"activation_checkpointing": ac, "activation_checkpointing_blocks": blocks}
        assert not estimate(model, auto.model_copy(update=update), 4, GB80).fits, (ac, blocks)


def test_auto_fills_the_memory_left_with_blocks_that_keep_everything():
    """Llama-3 8B at seq 8192 on four 80 GB GPUs with two micro-steps a step: pointwise everywhere fits with
    GiBs to spare, so auto recomputes in the fewest first blocks only; the line names them and what keeping
    everything needed."""
    model = ModelConfig(preset="llama-8b")
    auto = TrainConfig(parallel="fsdp", micro_batch=1, batch_tokens=2 * 4 * 8192)
    train, line = resolve(model, auto, 4, GB80)
    assert train.activation_checkpointing == "pointwise" and 0 < train.activation_checkpointing_blocks < 32
    n = train.activation_checkpointing_blocks
    assert line is not None and line.startswith(f"activation checkpointing: pointwise on {n} of 32 blocks (plan ")
    assert "; none would need " in line
    everywhere = estimate(model, train.model_copy(update={"activation_checkpointing_blocks": None}), 4, GB80)
    assert estimate(model, train, 4, GB80).total > everywhere.total  # it keeps more than pointwise everywhere


def test_fsdp_keeps_blocks_gathered_until_backward_where_the_plan_fits_and_reshards_where_not():
    """train.fsdp_reshard_after_forward=auto, settled after the checkpointing: llama-1b on four 80 GB GPUs
    keeps every block gathered (no second all-gather in backward); Llama-3 8B at seq 8192 cannot, and is
    resharded after each forward, the line saying what keeping them would need."""
    auto = TrainConfig(parallel="fsdp", micro_batch=4, batch_tokens=4 * 2048 * 4)
    small = ModelConfig(preset="llama-1b")
    train, line = resolve(small, auto, 4, GB80)
    assert train.fsdp_reshard_after_forward is False and train.activation_checkpointing == "none"
    assert line is not None and "\nfsdp: every block stays gathered from its forward to its backward (plan " in line
    kept, resharded = (
        estimate(small, train.model_copy(update={"fsdp_reshard_after_forward": r}), 4, GB80) for r in (False, True)
    )
    block = registry.spec("llama").terms(registry.resolve(small, 50257)).block
    assert kept.working - resharded.working == 2 * block * (16 - 2)  # bf16: all 16 blocks gathered, not 2
    assert estimate(small, auto, 4, GB80) == kept  # a plan of auto is the plan of what it chooses
    big = TrainConfig(parallel="fsdp", micro_batch=1, batch_tokens=8192 * 4)
    train, line = resolve(ModelConfig(preset="llama-8b"), big, 4, GB80)
    assert train.fsdp_reshard_after_forward is True and train.activation_checkpointing == "none"
    assert line is not None and "fsdp: each block resharded after its forward" in line
    assert "keeping them gathered would need" in line


def test_resharding_auto_is_true_silently_under_ddp_and_on_cpu_and_an_explicit_value_stays():
    model = ModelConfig(preset="llama-1b")
    for t, device_bytes in ((TrainConfig(parallel="ddp"), GB80), (TrainConfig(parallel="fsdp"), None)):
        settled, line = resolve(model, t.model_copy(update={"activation_checkpointing": "none"}), 4, device_bytes)
        assert settled.fsdp_reshard_after_forward is True and line is None
    for value in (True, False):
        t = TrainConfig(parallel="fsdp", activation_checkpointing="none", fsdp_reshard_after_forward=value)
        settled, line = resolve(model, t, 4, GB80)
        assert settled.fsdp_reshard_after_forward is value and line is None


def test_partial_checkpointing_is_costed_with_the_per_block_terms():
    """Each block recomputed trades its whole activations for its input (full), its selective ones (selective)
    or its matmuls' and attention's outputs (pointwise); all blocks is the mode itself, as before."""
    model = _wide_llama(32)

    def act(ac="full", blocks=None):
        t = TrainConfig(
            parallel="fsdp", micro_batch=1, activation_checkpointing=ac, activation_checkpointing_blocks=blocks
        )
        return estimate(model, t, 4, GB80).activations

    terms = registry.spec("llama").terms(registry.resolve(model, 50257))
    per_token = terms.activations | terms.compiled  # compiled: on by default on a GPU
    step = act(blocks=10) - act(blocks=11)
    assert step == 8192 * (per_token["none"] - per_token["full"])  # micro_batch 1 x 8192 tokens
    assert act(blocks=11) - act(blocks=12) == step  # linear in the blocks
    assert act(blocks=32) == act()
    assert act(blocks=1) > act("none")  # one block recomputed costs its recomputation: it never helps alone
    sel = act("selective", blocks=10) - act("selective", blocks=11)
    assert sel == 8192 * (per_token["none"] - per_token["selective"])
    assert act("selective", blocks=11) - act("selective", blocks=12) == sel
    assert act("selective", blocks=32) == act("selective")
    assert act("none") - act("selective", blocks=1) == sel  # no extra block's worth: recomputed op by op
    pw = act("pointwise", blocks=10) - act("pointwise", blocks=11)
    assert pw == 8192 * (per_token["none"] - per_token["pointwise"]) and 0 < pw < sel
    assert act("none") - act("pointwise", blocks=1) == pw


@pytest.mark.parametrize(
    "n_layer, ac, blocks, fix",
    [
        (60, "none", None, "full with train.activation_checkpointing_blocks=37"),
        (60, "selective", None, "full with train.activation_checkpointing_blocks=37"),
        (42, "none", None, "pointwise with train.activation_checkpointing_blocks=21"),
        (42, "pointwise", 5, "pointwise with train.activation_checkpointing_blocks=21"),
        (42, "selective", 5, "selective with train.activation_checkpointing_blocks=12"),
    ],
)
def test_explicit_checkpointing_that_does_not_fit_names_the_fewest_blocks_that_would(n_layer, ac, blocks, fix):
    """The suggestion walks auto's order from the setting given: pointwise on the fewest first blocks before
    pointwise everywhere, before selective on the fewest first blocks, ... before full on the fewest first
    blocks."""
    t = TrainConfig(parallel="fsdp", micro_batch=1, activation_checkpointing=ac, activation_checkpointing_blocks=blocks)
    with pytest.raises(UserError, match=r"it would fit with train\.activation_checkpointing=" + fix + "( or |$)"):
        check(estimate(_wide_llama(n_layer), t, 4, GB80))


def test_auto_without_a_gpu_is_none_and_the_smoke_output_stays_as_it_was(capsys):
    cfg = load_recipe("smoke", ["model.preset=llama-tiny"])
    assert cfg.train.activation_checkpointing == "auto"  # the default
    planned = plan_memory(cfg, 257, Dist(0, 0, 1, torch.device("cpu")))
    assert planned.train.activation_checkpointing == "none" and cfg.train.activation_checkpointing == "auto"
    assert capsys.readouterr().out == ""


def test_more_checkpointed_blocks_than_the_model_has_is_a_user_error_before_training():
    """The config validator cannot see an init_from model's blocks; the plan refuses them in one line."""
    full = TrainConfig(activation_checkpointing="full", activation_checkpointing_blocks=3)
    with pytest.raises(UserError, match=r"activation_checkpointing_blocks is 3 but the model has 2 blocks"):
        resolve(ModelConfig(preset="llama-tiny"), full, 1, None, 257)


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_the_ddp_path_compiles_the_whole_model_or_each_block_as_train_compile_scope_says(scope):
    from torch._dynamo.eval_frame import OptimizedModule

    sets = ["model.preset=llama-tiny", "train.compile=true", f"train.compile_scope={scope}"]
    cfg = load_recipe("smoke", [*sets, "train.activation_checkpointing=none"])
    raw = _tiny()
    model, _ = prepare_model(raw, cfg, Dist(0, 0, 1, torch.device("cpu")))
    assert isinstance(model, OptimizedModule) == (scope == "model")
    compiled_blocks = [b._compiled_call_impl is not None for b in raw.layers]
    assert compiled_blocks == [scope == "blocks"] * len(raw.layers)
    assert set(raw.state_dict()) == set(_tiny().state_dict())  # the checkpoint's names either way
