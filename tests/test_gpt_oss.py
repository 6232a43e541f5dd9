"""GPT-OSS (issue 37) against transformers' GptOssForCausalLM: logits with left padding and a sliding window shorter
than the rows (stacked and unrolled), each GPT-OSS feature shown to matter (an ablated one moves the logits far past
the tolerance), greedy KV-cache decoding = `generate`, the multi-turn `extend` and the training forward = the full
forward, routing replay, the export round trip, LoRA, MXFP4 checkpoints (dequantized as transformers' own
`convert_moe_packed_tensors`), both config spellings, and the options refused by name."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from rloo_jax import sampling
from rloo_jax.logprobs import per_token_logps_from_hidden
from rloo_jax.models import (
    ModelLoadError,
    config_from_hf,
    load_causal_lm,
    load_reward_model,
    lora_spec,
    moe,
    save_pretrained,
)
from rloo_jax.models.attention import _NEG, sink_softmax
from rloo_jax.models.loaded import convert
from rloo_jax.models.lora import with_adapters
from tests.checkpoints import PAD_ID, build_gpt_oss

# rows of 9 tokens, left padded: longer than the sliding window (4) of layers 0 and 2
PROMPT_IDS = np.array([[0, 0, 0, 17, 90, 41, 5, 7, 9], [5, 210, 33, 8, 150, 77, 64, 3, 4],
                       [0, 0, 120, 9, 250, 31, 3, 8, 8]], np.int32)
PROMPT_MASK = (PROMPT_IDS != PAD_ID).astype(np.int32)
TOL = 1e-5  # float32 logits; measured <= 2e-6


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def model(path):
    return load_causal_lm(path)


def _hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(np.asarray(ids)).long(),
                  attention_mask=torch.tensor(np.asarray(mask)).long()).logits.numpy()


_logits = jax.jit(lambda m, ids, mask: m(ids, mask))


def _diff(model, ref):
    ours = np.asarray(_logits(model, jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)))
    return np.abs(ours - ref)[PROMPT_MASK == 1].max()


# ------------------------------------------------------------------------------------------------ the model
def test_logits_equal_transformers(path, hf, model):
    """Left-padded float32 logits = transformers', stacked (scan) and unrolled."""
    cfg = model.config
    assert cfg.windows == (4, None, 4, None) and cfg.attention_sinks and cfg.rope_type == "yarn"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 16)
    ref = _hf_logits(hf, PROMPT_IDS, PROMPT_MASK)
    for scan in (True, False):
        diff = _diff(load_causal_lm(path, scan_layers=scan), ref)
        print(f"scan={scan}: logits vs transformers max abs diff {diff:.2e}")
        assert diff <= TOL


def test_reward_model_scores_equal_transformers(tmp_path):
    """GptOssForSequenceClassification (num_labels 1) loads as a reward model: scores at the last real token =
    transformers' (left padding, float32)."""
    path = build_gpt_oss(tmp_path / "rm", seed=8, reward=True)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(PROMPT_IDS).long(), attention_mask=torch.tensor(PROMPT_MASK).long()
                 ).logits[:, 0].numpy()
    ours = np.asarray(jax.jit(lambda m, i, k: m(i, k))(load_reward_model(path), PROMPT_IDS, PROMPT_MASK))
    print(f"reward scores vs transformers max abs diff {np.abs(ours - ref).max():.2e}")
    assert np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("ablation", [
    "no sinks", {"sliding_window": 64}, {"swiglu_limit": 1e6}, {"router_topk_softmax": False},
    {"rope_type": "default", "rope_factors": ()},
])
def test_each_feature_matters(hf, model, ablation):
    """The logits test can fail: without the sinks (their logits at -1e9: out of every softmax), with a window
    longer than the rows, without the clamp, with Qwen3-MoE's router weights (softmax over all experts, not
    renormalised) or without YaRN (and its attention factor), the same weights' logits move far past the
    tolerance."""
    graphdef, state = nnx.split(nnx.clone(model))  # the module-scoped model stays as loaded
    if ablation == "no sinks":
        sinks = state["model"]["layers"]["attn"]["sinks"]
        sinks.value = jnp.full_like(sinks.value, -1e9)
    else:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: model.__class__(model.config.replace(**ablation),
                                                                       nnx.Rngs(0))))
    diff = _diff(nnx.merge(graphdef, state), _hf_logits(hf, PROMPT_IDS, PROMPT_MASK))
    print(f"{ablation}: max abs diff {diff:.2e}")
    assert diff > 100 * TOL


def test_sink_softmax():
    """A sink logit joins the denominator only: transformers' concatenate-softmax-drop, and the plain softmax for
    a sink at -inf."""
    s = jnp.asarray([[0.3, -1.0, 2.0], [_NEG, 0.5, 0.1]], jnp.float32)
    sink = jnp.asarray([[0.7], [-0.2]], jnp.float32)
    ref = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[:, :-1]
    np.testing.assert_allclose(np.asarray(sink_softmax(s, sink)), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sink_softmax(s, jnp.full_like(sink, -jnp.inf))),
                               np.asarray(jax.nn.softmax(s, -1)), rtol=1e-6)


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "truncate": True, "original_max_position_embeddings": 64},  # the betas' defaults, truncated
    {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 512, "mscale": 0.7,
     "mscale_all_dim": 1.3},
    {"factor": 2.0, "original_max_position_embeddings": 256, "attention_factor": 1.25},
])
def test_yarn_equals_transformers(rope):
    """YaRN's inverse frequencies and attention factor = transformers' `_compute_yarn_parameters` (to an ulp),
    truncated or not, the betas' defaults, mscale / mscale_all_dim, an explicit attention_factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    sizes = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=64, intermediate_size=32, max_position_embeddings=8192)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(**sizes, rope_parameters=dict(rope)))
    ours = config_from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **sizes,
                           "rope_parameters": rope})
    from rloo_jax.models.config import rope_attention_factor, rope_inv_freq

    # theta ** (2i / d) in float32 by numpy's and torch's pow: they differ by one ulp at some i (measured)
    np.testing.assert_allclose(rope_inv_freq(64, ours.rope_theta, "yarn", ours.rope_factors), inv.numpy(),
                               rtol=3e-7, atol=0)
    assert rope_attention_factor("yarn", ours.rope_factors) == pytest.approx(factor, rel=1e-12)


def test_moe_pieces():
    """The router (top-k logits, softmax over them: the docstring examples) and the clamped SwiGLU."""
    logits = jnp.log(jnp.asarray([[1.0, 2.0, 3.0]]))
    experts, weights = moe.route(logits, 2, topk_softmax=True)
    np.testing.assert_array_equal(np.asarray(experts), [[2, 1]])
    np.testing.assert_allclose(np.asarray(weights), [[0.6, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(moe.gate_weights(logits, jnp.asarray([[0, 2]]), topk_softmax=True)),
                               [[0.25, 0.75]], rtol=1e-6)
    y = moe.clamped_swiglu(jnp.asarray([0.0, 9.0, -3.0]), jnp.asarray([5.0, 9.0, -9.0]), 1.0, 7.0)
    np.testing.assert_allclose(np.asarray(y), [0.0, 56 * jax.nn.sigmoid(7.0), -6 * -3 * jax.nn.sigmoid(-3.0)],
                               rtol=1e-6)


# ------------------------------------------------------------------------------------------------ sampling, training
def test_greedy_decode_equals_generate(hf, model):
    """Prefill + KV-cache decode (sinks, the window over prompt and generated keys) = transformers' greedy
    `generate`, each choice clear of the runner-up."""
    c = 8
    ours = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(0), max_new_tokens=c,
                             temperature=0.0, pad_token_id=PAD_ID, prompt_bucket=16)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(PROMPT_IDS).long(),
                          attention_mask=torch.from_numpy(PROMPT_MASK).long(), do_sample=False, max_new_tokens=c,
                          eos_token_id=None, pad_token_id=PAD_ID, top_k=None, top_p=None, temperature=None)
    expected = out[:, PROMPT_IDS.shape[1]:].numpy()
    ids = np.concatenate([PROMPT_IDS, expected], axis=1)
    logits = _hf_logits(hf, ids, np.concatenate([PROMPT_MASK, np.ones_like(expected)], axis=1))
    top2 = np.sort(logits[:, PROMPT_IDS.shape[1] - 1:-1], axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3
    np.testing.assert_array_equal(np.asarray(ours.completion_ids), expected)
    assert len(set(map(tuple, expected))) == 3


def test_extend_and_training_forward_equal_transformers(hf, model):
    """The multi-turn sampler's `extend` (several tokens per row at per-row slots, on a decode cache) and the
    training forward (each prompt once for its G completions) give transformers' logits of [prompt; completion]."""
    graphdef, state = nnx.split(model)
    ids, mask = jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)
    g, c = 2, 6
    comp = np.random.RandomState(1).randint(3, 280, (3 * g, c)).astype(np.int32)
    cmask = np.ones_like(comp)
    cmask[1, 4:] = 0

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        _, prompt_cache = m.prefill(ids, mask, c)
        ext, _ = m.extend(jnp.asarray(comp), jnp.zeros((3 * g,), jnp.int32), jnp.asarray(cmask) > 0,
                          m.init_decode_cache(prompt_cache, g, c))
        h, _ = m.completion_states(ids, mask, jnp.asarray(comp), jnp.asarray(cmask))
        return ext, m.unembed(h)

    ext, train = (np.asarray(x) for x in run(state))
    full = np.concatenate([np.repeat(PROMPT_IDS, g, 0), comp], axis=1)
    full_mask = np.concatenate([np.repeat(PROMPT_MASK, g, 0), cmask], axis=1)
    ref = _hf_logits(hf, full, full_mask)
    p = PROMPT_IDS.shape[1]
    real = cmask > 0
    d_ext = np.abs(ext - ref[:, p:])[real].max()
    d_train = np.abs(train - ref[:, p - 1:-1])[real].max()
    print(f"extend vs transformers {d_ext:.2e}; training forward vs transformers {d_train:.2e}")
    assert d_ext <= TOL and d_train <= TOL


def test_forward_aux_loss_equals_transformers(hf, model):
    """The training forward's load-balancing loss (the router's logits with its bias) = transformers' `aux_loss`
    over the G [prompt; completion] rows."""
    g = 2
    comp = np.random.RandomState(3).randint(3, 280, size=(3 * g, 5)).astype(np.int32)
    cmask = np.ones_like(comp)
    cmask[1, 3:] = 0
    _, ours = jax.jit(lambda m: m.completion_states(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK),
                                                    jnp.asarray(comp), jnp.asarray(cmask)))(model)
    ids = np.concatenate([np.repeat(PROMPT_IDS, g, 0), comp], axis=1)
    mask = np.concatenate([np.repeat(PROMPT_MASK, g, 0), cmask], axis=1)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                 output_router_logits=True).aux_loss.item()
    print(f"aux loss {float(ours):.6f} vs transformers {ref:.6f}")
    assert abs(float(ours) - ref) <= 1e-5 * abs(ref)


@jax.jit
def _training(model, ids, mask, routes):
    h, _ = model.completion_states(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK), ids, mask, routes=routes)
    return per_token_logps_from_hidden(h, model.unembed, ids, 1.0)


@pytest.fixture(scope="module")
def gen(model):
    """A sampled rollout (2 completions of 6 tokens per prompt, temperature 1) with the sampler's routes."""
    return sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(2), max_new_tokens=6,
                             num_generations=2, temperature=1.0, pad_token_id=PAD_ID, prompt_bucket=16)


def test_routing_replay(model, gen):
    """The sampler's recorded experts, replayed by the training forward, give the sampler's log-probs; with a
    perturbed router (as after an update) replay keeps the sampler's experts, the gate weights the softmax of the
    new router's logits at them (so the log-probs move, but less than the router's own choice moves them)."""
    mask = np.asarray(gen.completion_mask) > 0
    replayed = np.asarray(_training(model, gen.completion_ids, gen.completion_mask, gen.routes))
    diff = np.abs(replayed - np.asarray(gen.logps))[mask].max()
    print(f"replay: training vs sampler log-probs max abs diff {diff:.2e}")
    assert diff <= 1e-5
    graphdef, state = nnx.split(nnx.clone(model))
    bias = state["model"]["layers"]["mlp"]["router_bias"]
    bias.value = bias.value + 0.5 * jax.random.normal(jax.random.key(9), bias.value.shape)
    moved = nnx.merge(graphdef, state)
    kept = np.asarray(_training(moved, gen.completion_ids, gen.completion_mask, gen.routes))
    own = np.asarray(_training(moved, gen.completion_ids, gen.completion_mask, None))
    assert np.abs(kept - replayed)[mask].max() > 1e-4  # the gate weights follow the new router
    assert np.abs(own - kept)[mask].max() > 1e-4  # and the experts are the sampler's, not the new choice


def test_gradients_reach_every_gpt_oss_parameter(model, gen):
    """The training forward under routing replay is differentiable in every parameter GPT-OSS adds: the sinks, the
    router's weight and bias (through the replayed experts' gate weights), the experts' weights and biases; all
    finite."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def grads(params):
        def loss(p):
            logps = _training(nnx.merge(graphdef, p), gen.completion_ids, gen.completion_mask, gen.routes)
            return jnp.sum(logps * gen.completion_mask)
        return jax.grad(loss)(params)

    g = nnx.to_flat_state(grads(params))
    norms = {".".join(map(str, path)): float(jnp.abs(v.value).max()) for path, v in g}
    assert all(np.isfinite(n) for n in norms.values())
    for name in ("attn.sinks", "mlp.router", "mlp.router_bias", "mlp.experts_gate", "mlp.experts_up_bias",
                 "mlp.experts_down_bias"):
        assert norms[f"model.layers.{name}"] > 1e-4, (name, norms[f"model.layers.{name}"])


# ------------------------------------------------------------------------------------------------ files
def test_export_round_trip(path, hf, model, tmp_path):
    """save_pretrained writes transformers' tensors bit for bit and a config.json that transformers and we load
    back to the same logits."""
    out = save_pretrained(model, tmp_path / "export")
    theirs, ours = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    again = load_causal_lm(out)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf_again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_array_equal(_hf_logits(hf_again, PROMPT_IDS, PROMPT_MASK),
                                  _hf_logits(hf, PROMPT_IDS, PROMPT_MASK))


def test_lora_zero_adapters_equal_the_base(model):
    """LoRA all-linear adapts the attention projections (the router and experts carry none); zero B gives the
    base's logits, and a nonzero B changes them."""
    lora = with_adapters(model, lora_spec("llama", 4, 8.0, targets="all-linear"), jax.random.key(0))
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(lora))}
    assert any("attn.o.lora_b" in n for n in names) and not any("mlp" in n and "lora" in n for n in names)
    ids, mask = jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)
    np.testing.assert_array_equal(np.asarray(_logits(lora, ids, mask)), np.asarray(_logits(model, ids, mask)))
    graphdef, state = nnx.split(lora)
    b = state["model"]["layers"]["attn"]["o"]["lora_b"]
    b.value = b.value + 0.1
    assert np.abs(np.asarray(_logits(nnx.merge(graphdef, state), ids, mask))
                  - np.asarray(_logits(model, ids, mask))).max() > 1e-3


def test_loaded_model_converts_as_its_folder(hf, model):
    """A transformers GptOssForCausalLM object (TRL's `model=`) converts in memory to the folder's parameters and
    config (`rloo_jax.models.loaded.convert`)."""
    converted = convert(hf)
    assert converted.config == model.config
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(converted)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mxfp4_checkpoint(src, out):
    """`src`'s checkpoint with its experts replaced by random MXFP4 tensors (random FP4 codes, scales 2^-7..2^-3),
    stored as GPT-OSS's hub files store them (`*_blocks` [E, R, G, 16] / `*_scales` [E, R, G] uint8,
    quantization_config mxfp4). -> the packed tensors."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    rs, packed = np.random.RandomState(5), {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, rows, cols = tensors.pop(name).shape  # in-memory [E, in, out]: the file packs [E, out, in / 32, 16]
        packed[f"{name}_blocks"] = rs.randint(0, 256, (e, cols, rows // 32, 16)).astype(np.uint8)
        packed[f"{name}_scales"] = rs.randint(120, 125, (e, cols, rows // 32)).astype(np.uint8)
    save_file({**tensors, **packed}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return packed


def test_mxfp4_checkpoint(tmp_path_factory):
    """An MXFP4 checkpoint loads with its experts dequantized exactly as transformers' `convert_moe_packed_tensors`
    (float32 and bf16), its logits = transformers' model holding those dequantized experts, and it exports
    dequantized (no quantization_config)."""
    src = build_gpt_oss(tmp_path_factory.mktemp("gpt_oss_f"), seed=4, intermediate_size=32)
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt"
    packed = _mxfp4_checkpoint(src, path)
    ours32, ours16 = load_causal_lm(path), load_causal_lm(path, dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    sd = {}
    for i in range(4):
        for proj, ours_names in (("gate_up_proj", ("experts_gate", "experts_up")), ("down_proj", ("experts_down",))):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = (torch.from_numpy(packed[f"{name}_{k}"]) for k in ("blocks", "scales"))
            ref = {dt: convert_moe_packed_tensors(blocks, scales, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
            np.testing.assert_array_equal(moe.mxfp4_dequantize(packed[f"{name}_blocks"], packed[f"{name}_scales"]),
                                          ref[torch.float32].numpy())
            for m, dt in ((ours32, torch.float32), (ours16, torch.bfloat16)):
                params = nnx.state(m)["model"]["layers"]["mlp"]
                mine = [np.asarray(params[n].value[i]) for n in ours_names]
                want = ref[dt].float().numpy()
                got = np.stack(mine, -1).reshape(want.shape) if len(mine) == 2 else mine[0]
                np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=f"{name} {dt}")
                assert got.dtype == (np.float32 if dt == torch.float32 else ml_dtypes.bfloat16)
            sd[name] = ref[torch.float32]
    hf.load_state_dict(sd, strict=False)
    diff = _diff(ours32, _hf_logits(hf, PROMPT_IDS, PROMPT_MASK))
    print(f"MXFP4: logits vs transformers on the dequantized experts max abs diff {diff:.2e}")
    assert diff <= TOL
    out = save_pretrained(ours32, tmp_path_factory.mktemp("gpt_oss_mxfp4_export"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    written = load_file(str(out / "model.safetensors"))
    assert not any(k.endswith(("_blocks", "_scales")) for k in written)
    np.testing.assert_array_equal(written["model.layers.1.mlp.experts.down_proj"],
                                  sd["model.layers.1.mlp.experts.down_proj"].numpy())


# ------------------------------------------------------------------------------------------------ configs
def test_both_spellings(path):
    """The hub's `num_experts` and old `rope_scaling` (+ top-level rope_theta) read as transformers 5's
    `num_local_experts` and `rope_parameters`; a config without rope settings gets GptOssConfig's YaRN."""
    written = json.loads((path / "config.json").read_text())
    rope = dict(written["rope_parameters"])
    theta = rope.pop("rope_theta")
    old = {k: v for k, v in written.items() if k not in ("num_local_experts", "rope_parameters")}
    old |= {"num_experts": 8, "rope_scaling": rope, "rope_theta": theta}
    assert config_from_hf(old) == config_from_hf(written)
    bare = config_from_hf({k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta")})
    assert bare.rope_type == "yarn" and bare.rope_theta == 150000.0
    assert dict(bare.rope_factors)["attention_factor"] == pytest.approx(0.1 * np.log(32) + 1)


def test_gpt_oss_config_defaults():
    """A config.json with only the sizes reads as GptOssConfig's defaults (head_dim 64, 8 kv heads, attention biases,
    alternating layers with a window of 128, 128 experts top 4, the clamped SwiGLU's 7.0 and 1.702, YaRN x32)."""
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, intermediate_size=16)
    ours = config_from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **sizes})
    theirs = transformers.GptOssConfig(**sizes)
    assert (ours.head_dim, ours.num_kv_heads, ours.qkv_bias, ours.o_bias) == (theirs.head_dim,
                                                                             theirs.num_key_value_heads, True, True)
    assert ours.layer_types == tuple(theirs.layer_types) and ours.sliding_window == theirs.sliding_window == 128
    assert (ours.num_experts, ours.num_experts_per_tok, ours.swiglu_limit, ours.swiglu_alpha, ours.norm_eps) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.swiglu_limit, theirs.swiglu_alpha,
        theirs.rms_norm_eps)
    rope = theirs.rope_parameters
    assert ours.rope_type == rope["rope_type"] and ours.rope_theta == rope["rope_theta"]
    assert dict(ours.rope_factors)["factor"] == rope["factor"] and dict(ours.rope_factors)["truncate"] is False


@pytest.mark.parametrize("change, option", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}}, "rope_type"),
])
def test_unsupported_option_fails_at_load_naming_it(path, change, option):
    hf = json.loads((path / "config.json").read_text()) | change
    with pytest.raises(ModelLoadError, match=option) as e:
        config_from_hf(hf)
    assert str(e.value).count("not supported") == 1


def test_attention_implementations(path, hf):
    """splash (interpreted off a TPU) computes the sinks in its kernel: the same logits as transformers'; cudnn
    cannot, and asked for by name it is refused at load, naming the option."""
    diff = _diff(load_causal_lm(path, attn_implementation="splash"), _hf_logits(hf, PROMPT_IDS, PROMPT_MASK))
    print(f"splash: logits vs transformers max abs diff {diff:.2e}")
    assert diff <= TOL
    with pytest.raises(ModelLoadError, match="attn_implementation='cudnn' cannot compute attention sinks"):
        load_causal_lm(path, attn_implementation="cudnn")



def test_the_gpu_default_attention_is_one_with_sinks(path, tiny_checkpoint, tmp_path):
    """Where the platform picks the attention (attn_implementation None) and would pick cuDNN (a GPU in bf16), a
    GPT-OSS run takes the einsum instead, and says so; cudnn asked for by name stays an error (prepared for a GPU
    on this CPU: `build.prepare(platform="gpu")` resolves the options and loads the model, nothing runs)."""
    import shutil

    from rloo_jax import build
    from rloo_jax.algorithms import GRPOConfig

    model_dir = tmp_path / "m"
    shutil.copytree(path, model_dir)
    for f in tiny_checkpoint("tokenizer").iterdir():
        shutil.copy(f, model_dir / f.name)

    def prepared(attn):
        cfg = GRPOConfig(output_dir=str(tmp_path / "o"), model_name_or_path=str(model_dir), dataset_name="demo",
                         reward_funcs=["rloo_jax.demo:letters_reward"], attn_implementation=attn,
                         per_device_train_batch_size=8, num_generations=4)
        return build.prepare(cfg, platform="gpu")

    auto = prepared(None)
    assert (auto.cfg.attn_implementation, auto.model.config.attn_implementation) == ("eager", "eager")
    assert "attn_implementation eager* (cuDNN's attention has no sinks)" in auto.description
    with pytest.raises(ModelLoadError, match="attn_implementation='cudnn' cannot compute attention sinks"):
        prepared("cudnn")
