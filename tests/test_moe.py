"""Qwen3-MoE (issue 37) against transformers' Qwen3MoeForCausalLM: logits with left padding (all layers routed, and
a mix of dense and routed layers from `decoder_sparse_step` + `mlp_only_layers`), greedy KV-cache decoding =
`generate`, export round trip, both spellings of the expert count, the unsupported-option error, the load-balancing
loss = transformers' `load_balancing_loss_func`, and routing replay (the sampler's routes, replayed by the
training forward, give the sampler's log-probs)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file
from transformers.models.qwen3_moe import modeling_qwen3_moe

import rloo_jax as rj
from rloo_jax import sampling
from rloo_jax.errors import ConfigError
from rloo_jax.logprobs import per_token_logps_from_hidden
from rloo_jax.models import (
    ModelLoadError,
    config_from_hf,
    init_causal_lm,
    load_adapter,
    load_causal_lm,
    load_reward_model,
    lora_spec,
    moe,
    save_adapter,
    save_pretrained,
)
from rloo_jax.models.loaded import convert
from rloo_jax.models.lora import init_adapters, split_adapters, with_adapters
from rloo_jax.models.transformer import Routes
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.step import Step, StepConfig, replayed_routes, router_aux_loss_coef
from tests.checkpoints import PAD_ID, build_qwen3_moe

PROMPT_IDS = np.array([[0, 0, 0, 17, 90, 41, 5], [5, 210, 33, 8, 150, 77, 64], [0, 0, 120, 9, 250, 31, 3]], np.int32)
PROMPT_MASK = (PROMPT_IDS != PAD_ID).astype(np.int32)
TOL = 1e-5  # float32 logits; measured <= 2e-6

# uniform: every layer routed, 8 experts top-2 renormalised (Qwen3-30B-A3B's norm_topk_prob); mixed: 4 layers,
# decoder_sparse_step 2 routes layers 1 and 3, mlp_only_layers [3] makes 3 dense again: only layer 1 routed
CONFIGS = {
    "uniform": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixed": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=4,
                  decoder_sparse_step=2, mlp_only_layers=[3]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    paths = {}

    def get(name):
        if name not in paths:
            paths[name] = build_qwen3_moe(tmp_path_factory.mktemp(f"qwen3_moe_{name}"), **CONFIGS[name])
        return paths[name]

    return get


def _hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(np.asarray(ids)).long(),
                  attention_mask=torch.tensor(np.asarray(mask)).long()).logits.numpy()


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_equal_transformers(checkpoint, name):
    """Left-padded logits = transformers' in float32, stacked (scan) and unrolled; the mixed model runs unrolled
    whatever scan_layers says (its blocks differ)."""
    path = checkpoint(name)
    ref = _hf_logits(_hf(path), PROMPT_IDS, PROMPT_MASK)
    for scan in (True, False):
        model = load_causal_lm(path, scan_layers=scan)
        assert model.config.sparse_layers == ((True,) * 2 if name == "uniform" else (False, True, False, False))
        assert model.config.scan_layers == (scan and name == "uniform")
        ours = np.asarray(model(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)))
        diff = np.abs(ours - ref)[PROMPT_MASK == 1].max()
        print(f"{name} scan={scan}: logits vs transformers max abs diff {diff:.2e}")
        assert diff <= TOL


def test_greedy_decode_equals_generate_and_full_forward(checkpoint):
    """Prefill + KV-cache decode (the routed MLP on one token per row) = transformers' greedy `generate`."""
    path, c = checkpoint("uniform"), 8
    model, hf = load_causal_lm(path), _hf(path)
    ours = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(0), max_new_tokens=c,
                             temperature=0.0, pad_token_id=PAD_ID, prompt_bucket=8)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(PROMPT_IDS).long(),
                          attention_mask=torch.from_numpy(PROMPT_MASK).long(), do_sample=False, max_new_tokens=c,
                          eos_token_id=None, pad_token_id=PAD_ID, top_k=None, top_p=None, temperature=None)
    expected = out[:, PROMPT_IDS.shape[1]:].numpy()
    ids = np.concatenate([PROMPT_IDS, expected], axis=1)
    logits = _hf_logits(hf, ids, np.concatenate([PROMPT_MASK, np.ones_like(expected)], axis=1))
    top2 = np.sort(logits[:, PROMPT_IDS.shape[1] - 1:-1], axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # every greedy choice was clear
    np.testing.assert_array_equal(np.asarray(ours.completion_ids), expected)
    assert len(set(map(tuple, expected))) == 3


@pytest.mark.parametrize("name", CONFIGS)
def test_export_round_trip(checkpoint, name, tmp_path):
    """save_pretrained writes transformers' tensors bit for bit (one per expert) and a config.json that
    transformers and we load back to the same logits."""
    path = checkpoint(name)
    model = load_causal_lm(path)
    out = save_pretrained(model, tmp_path / "export")
    theirs, ours = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["num_local_experts"] == CONFIGS[name]["num_experts"] and "num_experts" not in hf_cfg
    again = load_causal_lm(out)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf_again = _hf(out)
    np.testing.assert_array_equal(_hf_logits(hf_again, PROMPT_IDS, PROMPT_MASK),
                                  _hf_logits(_hf(path), PROMPT_IDS, PROMPT_MASK))


def test_reward_model_scores_equal_transformers(tmp_path):
    """Qwen3MoeForSequenceClassification (num_labels 1) loads as a reward model: scores at the last real token =
    transformers' (left padding, float32)."""
    path = build_qwen3_moe(tmp_path / "rm", seed=8, reward=True, **CONFIGS["uniform"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(PROMPT_IDS).long(), attention_mask=torch.tensor(PROMPT_MASK).long()
                 ).logits[:, 0].numpy()
    ours = np.asarray(jax.jit(lambda m, i, k: m(i, k))(load_reward_model(path), PROMPT_IDS, PROMPT_MASK))
    assert np.abs(ours - ref).max() <= TOL


def test_fused_experts_and_hub_spelling(checkpoint):
    """transformers' in-memory experts (fused `gate_up_proj` / `down_proj`) convert to the same parameters as the
    file's per-expert tensors, and the hub's `num_experts` reads as transformers 5's `num_local_experts`."""
    path = checkpoint("mixed")
    hf = _hf(path)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hf.state_dict())
    a, b = load_causal_lm(path), convert(hf)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    written = json.loads((path / "config.json").read_text())
    hub = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert config_from_hf(hub) == config_from_hf(written)


@pytest.mark.parametrize("option, value", [("shared_expert_intermediate_size", 32), ("router_type", "expert_choice"),
                                           ("moe_capacity_factor", 1.25)])
def test_unsupported_option_fails_at_load_naming_it(checkpoint, tmp_path, option, value):
    path = checkpoint("uniform")
    hf = json.loads((path / "config.json").read_text()) | {option: value}
    with pytest.raises(ModelLoadError, match=option) as e:
        config_from_hf(hf)
    assert str(e.value).count("not supported") == 1


# ------------------------------------------------------------------------------------------------ aux loss
def test_load_balancing_loss_equals_transformers():
    """The per-layer statistics summed over layers = transformers' `load_balancing_loss_func` on the same router
    logits with an attention mask."""
    rs = np.random.RandomState(0)
    layers, b, t, e, k = 3, 2, 5, 8, 2
    logits = rs.normal(size=(layers, b * t, e)).astype(np.float32) * 2
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)
    ref = modeling_qwen3_moe.load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), e, k,
                                                      torch.tensor(mask)).item()
    stats = [moe.load_balancing_stats(jnp.asarray(x), jnp.asarray(mask.reshape(-1)), k) for x in logits]
    counts, probs = (sum(s[i] for s in stats) for i in (0, 1))
    ours = float(moe.load_balancing_loss(counts, probs, jnp.float32(mask.sum() * layers)))
    assert abs(ours - ref) <= 1e-6 * abs(ref), (ours, ref)


def test_forward_aux_loss_equals_transformers(checkpoint):
    """The training forward's load-balancing loss (each prompt once, weighted G times) = transformers' `aux_loss`
    over the G [prompt; completion] rows (the forward TRL's GRPO takes it from); the mixed model's dense layers
    count in neither."""
    name = "mixed"
    path = checkpoint(name)
    model, hf = load_causal_lm(path), _hf(path)
    g = 2
    comp = np.random.RandomState(3).randint(3, 280, size=(3 * g, 5)).astype(np.int32)
    cmask = np.ones_like(comp)
    cmask[1, 3:] = 0
    _, ours = model.completion_states(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK), jnp.asarray(comp),
                                      jnp.asarray(cmask))
    ids = np.concatenate([np.repeat(PROMPT_IDS, g, 0), comp], axis=1)
    mask = np.concatenate([np.repeat(PROMPT_MASK, g, 0), cmask], axis=1)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                 output_router_logits=True).aux_loss.item()
    print(f"{name}: aux loss {float(ours):.6f} vs transformers {ref:.6f}")
    assert abs(float(ours) - ref) <= 1e-5 * abs(ref)


def test_router_aux_loss_coef_follows_trl():
    """TRL 1.16's rule: the option, else the checkpoint's router_aux_loss_coef (Qwen3MoeConfig's default 0.001);
    0.0 turns it off; set on a dense model it is an error."""
    moe_cfg = config_from_hf(qwen3_moe_dict())
    dense = moe_cfg.replace(num_experts=0)
    assert router_aux_loss_coef(None, moe_cfg) == 0.001
    assert router_aux_loss_coef(0.0, moe_cfg) == 0.0 and router_aux_loss_coef(0.02, moe_cfg) == 0.02
    assert router_aux_loss_coef(None, dense) == 0.0 and router_aux_loss_coef(0.0, dense) == 0.0
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        router_aux_loss_coef(0.02, dense)


def qwen3_moe_dict():
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 40,
            "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
            "num_experts_per_tok": 2, "initializer_range": 0.2}


def test_loss_adds_the_weighted_aux_loss():
    """A micro-batch's loss with router_aux_loss_coef c is the loss with 0 plus c times the load-balancing loss of
    its training forward (so its gradient adds c * d(aux)), which it logs as `aux_loss` (TRL's metric name)."""
    graphdef, params = nnx.split(init_causal_lm(qwen3_moe_dict(), seed=0))
    g, rs = 2, np.random.RandomState(0)
    mb = {"prompt_ids": jnp.asarray([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32),
          "prompt_mask": jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32),
          "completion_ids": jnp.asarray(rs.randint(4, 40, (2 * g, 4)), jnp.int32),
          "mask": jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], jnp.int32),
          "old_logps": jnp.zeros((2 * g, 4), jnp.float32), "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5])}
    sampling_cfg = sampling.SamplingConfig(max_new_tokens=4, num_generations=g, eos_token_ids=(3,), pad_token_id=0)

    def loss(c, p):
        cfg = StepConfig(sampling=sampling_cfg, algorithm=rj.RLOO(beta=0.0), router_aux_loss_coef=c)
        return Step(graphdef, optax.sgd(0.1), cfg).loss(p, None, mb, None, None, jnp.float32(1.0))

    @jax.jit
    def both(p):  # one compile
        model = nnx.merge(graphdef, p)
        aux = model.completion_states(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["mask"])[1]
        return loss(0.0, p), loss(0.3, p), aux

    (l0, (m0, _)), (l1, (m1, _)), aux = both(params)
    assert "aux_loss" not in m0
    assert float(m1["aux_loss"]) == pytest.approx(float(aux), rel=1e-6)
    assert float(l1 - l0) == pytest.approx(0.3 * float(aux), rel=1e-5)


# ------------------------------------------------------------------------------------------------ routing replay
@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, temperature, state, ids, mask, routes):
    """The training forward's log-probs of the completions [N, C] and the experts it routed them to [N, C, L, K]."""
    model = nnx.merge(graphdef, state)
    p_ids, p_mask = jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)
    h, _ = model.completion_states(p_ids, p_mask, ids, mask, routes=routes)
    logps = per_token_logps_from_hidden(h, model.unembed, ids, temperature)
    order = jnp.argsort(p_mask, axis=1, stable=True)  # completion_states left-aligns the prompts likewise
    p_ids, p_mask = jnp.take_along_axis(p_ids, order, 1), jnp.take_along_axis(p_mask, order, 1)
    *_, routing = model.model.forward_shared_prompt(p_ids, p_mask, ids, mask, routes=routes)
    experts = routing.experts[:, :, p_ids.shape[1]:].reshape(routing.experts.shape[0], *ids.shape, -1)
    return logps, jnp.moveaxis(experts, 0, 2)


def _training(model, gen, temperature, routes):
    graphdef, state = nnx.split(model)
    return _forward(graphdef, temperature, state, gen.completion_ids, gen.completion_mask, routes)


def test_routing_replay(checkpoint):
    """The sampler records each token's experts; the training forward replaying them gives the sampler's
    log-probs (1e-5, float32). A perturbed router (as after an update) routes some completion tokens elsewhere
    without replay; with replay it keeps the sampler's experts (the gate weights from the new router). Prompt
    routes recorded at the sampler's (bucketed) width fit the training forward's narrower prompts."""
    path = checkpoint("uniform")
    model = load_causal_lm(path)
    t = 0.8
    gen = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(2), max_new_tokens=8,
                            num_generations=2, temperature=t, pad_token_id=PAD_ID, prompt_bucket=16)
    routes = gen.routes
    n, c = gen.completion_ids.shape
    assert routes.completion.shape == (n, c, 2, 2) and routes.prompt.shape == (3, 16, 2, 2)  # wider than P = 7
    fed = np.asarray(routes.completion)[:, :-1]
    assert fed.min() >= 0 and (np.asarray(routes.completion)[:, -1] == -1).all()  # the last token is never fed
    mask = np.asarray(gen.completion_mask) > 0
    replayed, used = _training(model, gen, t, routes)
    diff = np.abs(np.asarray(replayed) - np.asarray(gen.logps))[mask].max()
    print(f"replay: training vs sampler log-probs max abs diff {diff:.2e}")
    assert diff <= 1e-5
    np.testing.assert_array_equal(np.asarray(used)[:, :-1], fed)
    narrow = Routes(prompt=routes.prompt[:, -PROMPT_IDS.shape[1]:], completion=routes.completion)
    np.testing.assert_array_equal(np.asarray(_training(model, gen, t, narrow)[0]), np.asarray(replayed))
    # on these weights the training forward's own routing (no replay) agrees with the sampler's
    np.testing.assert_array_equal(np.asarray(_training(model, gen, t, None)[1])[:, :-1], fed)

    graphdef, state = nnx.split(model)
    router = state["model"]["layers"]["mlp"]["router"]
    router.value = router.value + 0.02 * jax.random.normal(jax.random.key(9), router.value.shape)
    moved = nnx.merge(graphdef, state)
    own = np.asarray(_training(moved, gen, t, None)[1])[:, :-1]
    kept = np.asarray(_training(moved, gen, t, routes)[1])[:, :-1]
    differ = (np.sort(own, -1) != np.sort(fed, -1)).any(-1)  # [N, C-1, L]
    print(f"perturbed router: {differ.mean():.2%} of (token, layer) routes differ without replay")
    assert differ.any()
    np.testing.assert_array_equal(kept, fed)
    off = load_causal_lm(path, routing_replay=False)  # replay off: the router chooses whatever is recorded
    np.testing.assert_array_equal(np.asarray(_training(off, gen, t, routes)[1]),
                                  np.asarray(_training(off, gen, t, None)[1]))


def test_extend_records_routes_as_the_full_forward(checkpoint):
    """The multi-turn sampler's `extend` (several tokens per row at per-row slots) gives the full forward's logits
    and records the experts it routed each written token to."""
    graphdef, state = nnx.split(load_causal_lm(checkpoint("uniform")))
    ids, mask = jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, 280, (3, 4)), jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], bool)

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        _, prompt_cache = model.prefill(ids, mask, 6)
        logits, cache = model.extend(tokens, jnp.zeros((3,), jnp.int32), valid,
                                     model.init_decode_cache(prompt_cache, 1, 6))
        full_ids, full_mask = jnp.concatenate([ids, tokens], 1), jnp.concatenate([mask, jnp.ones_like(tokens)], 1)
        h, _, routing = model.model.forward_routed(full_ids, full_mask)
        return logits, cache.routes, model.unembed(h)[:, 7:], routing.experts[:, :, 7:]

    logits, routes, ref, experts = (np.asarray(x) for x in run(state))
    v = np.asarray(valid)
    assert np.abs(logits - ref)[v].max() <= TOL
    recorded = np.moveaxis(routes, 0, 2)  # [N, C, L, K]
    np.testing.assert_array_equal(recorded[:, :4][v], np.moveaxis(experts, 0, 2)[v])
    assert (recorded[:, :4][~v] == -1).all() and (recorded[:, 4:] == -1).all()


def test_step_replays_the_sampler_routes():
    """In the training step (routing replay on): the sampled rollout carries the sampler's routes, cut with the
    completions; the old-log-prob and reference forwards replay them in micro-batches (each prompt's routes with
    its G completions) and give the sampler's log-probs; an update runs on them. Routes follow run options:
    off with routing_replay false, absent for a dense policy."""
    moe_cfg = config_from_hf(qwen3_moe_dict())
    assert replayed_routes(True, moe_cfg, False) == (2, 2)
    assert replayed_routes(False, moe_cfg, False) is None
    assert replayed_routes(True, moe_cfg, True) is None  # multi-turn: the turns' sampler keeps none
    assert replayed_routes(True, moe_cfg.replace(num_experts=0), False) is None
    graphdef, params = nnx.split(init_causal_lm(qwen3_moe_dict(), seed=0))
    prompt_ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    prompt_mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)
    sampling_cfg = sampling.SamplingConfig(max_new_tokens=8, num_generations=2, temperature=0.9,
                                           eos_token_ids=(3,), pad_token_id=0)
    cfg = StepConfig(sampling=sampling_cfg, algorithm=rj.RLOO(beta=0.1), steps_per_generation=2,
                     recompute_old_logps=True, routes=(2, 2))
    programs = Programs(graphdef, optax.sgd(0.1), cfg)
    state = programs.init_state(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, params))
    sampled = programs.sample(state, prompt_ids, prompt_mask, jax.random.key(0))
    assert sampled.routes.completion.shape == (4, 8, 2, 2) and sampled.routes.prompt.shape == (2, 6, 2, 2)
    rollout = programs.finish(state, sampled, 4)  # cut to 4 positions
    assert rollout.routes.completion.shape == (4, 4, 2, 2)
    mask = np.asarray(rollout.completion_mask) > 0
    for name in ("old_logps", "ref_logps"):
        diff = np.abs(np.asarray(getattr(rollout, name)) - np.asarray(rollout.sampler_logps))[mask].max()
        assert diff <= 1e-5, (name, diff)
    new, _ = programs.update(state, rollout, jnp.asarray([[1.0], [0.0], [0.5], [0.2]]), jnp.ones((1,)))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.params))


def test_lora_on_a_mixture_of_experts(checkpoint, tmp_path):
    """LoRA ("all-linear") adapts the attention of every layer and the dense layers' MLPs (the experts and the
    router carry none, as peft finds no nn.Linear there in transformers 5): zero adapters give the base's logits, and
    the PEFT adapter folder round-trips."""
    path = checkpoint("mixed")
    base = load_causal_lm(path)
    model = with_adapters(base, lora_spec("llama", 4, 8.0, targets="all-linear"), jax.random.key(0))
    graphdef, adapters, rest = split_adapters(model)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert any("layers.1.attn.q" in n for n in names) and any("layers.0.mlp.gate" in n for n in names)
    assert not any("layers.1.mlp" in n for n in names)  # layer 1 is routed
    logits = jax.jit(lambda m: m(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK)))
    np.testing.assert_array_equal(np.asarray(logits(model)), np.asarray(logits(base)))
    drawn = jax.tree.map(lambda a: a + 0.01, init_adapters(adapters, jax.random.key(1)))
    trained = nnx.merge(graphdef, drawn, rest)
    out = save_adapter(trained, tmp_path / "adapter", str(path))
    again = load_adapter(out)
    for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(split_adapters(again)[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------ routing metrics
def test_route_mismatch_golden():
    recorded = jnp.asarray([[0, 2], [1, 3], [-1, -1], [2, 1]])
    chosen = jnp.asarray([[2, 0], [1, 2], [0, 1], [0, 3]])
    got = moe.route_mismatch(recorded, chosen, jnp.asarray([1, 1, 1, 0]))  # the last token is not counted
    assert [float(x) for x in got] == [1.0, 4.0]  # expert 3 of token 1; the same set in another order matches


@pytest.mark.parametrize("replay", [True, False])
def test_routing_metrics_sampler_vs_trainer(replay):
    """The update's `sampling/routing_mismatch` and the sampler/trainer gap (`sampling/sampling_logp_difference`,
    TRL's) on a constructed case: a policy with one routed layer (layer 0 dense, so the routed layer's input does
    not depend on routing) and top-1 renormalised routing (the gate weight is exactly 1, so replayed experts give the
    sampler's output whatever the router), sampled at parameters A and updated at B = A with another router, on
    policy. The trainer's own top-1 differs from the recorded one for the hand-counted share of the completion tokens
    the sampler fed, with or without replay; with replay the update's log-probs are the sampler's (1e-5, float32),
    without it they are not."""
    config = dict(qwen3_moe_dict(), num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[0])
    graphdef, params = nnx.split(init_causal_lm(config, seed=0))
    g, c = 2, 6
    prompt_ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    prompt_mask = (prompt_ids != 0).astype(jnp.int32)
    sampling_cfg = sampling.SamplingConfig(max_new_tokens=c, num_generations=g, temperature=1.0, eos_token_ids=(3,),
                                           pad_token_id=0)
    cfg = StepConfig(sampling=sampling_cfg, algorithm=rj.RLOO(beta=0.0), routes=(2, 1), routing_replay=replay)
    assert cfg.on_policy and not cfg.recompute  # the gap is measured in the update's forward
    programs = Programs(graphdef, optax.sgd(0.1), cfg)
    state = programs.init_state(jax.tree.map(jnp.copy, params))
    rollout = programs.finish(state, programs.sample(state, prompt_ids, prompt_mask, jax.random.key(4)), c)
    moved = jax.tree.map(jnp.copy, params)
    (path, router), = [(p, v) for p, v in nnx.to_flat_state(moved) if "router" in p]
    router.value = router.value + 0.3 * jax.random.normal(jax.random.key(9), router.value.shape)
    rewards = jnp.asarray([[1.0], [0.0], [0.5], [0.2]])
    _, metrics = programs.update(state.replace(params=jax.tree.map(jnp.copy, moved)), rollout, rewards,
                                 jnp.ones((1,)))  # the update donates its state: `moved` stays for the hand count
    metrics = {k: float(v) for k, v in flat_metrics(metrics).items()}

    # by hand: B's own top-1 of each completion token at the routed layer (a forward without routes to replay)
    model = nnx.merge(graphdef, moved)
    order = jnp.argsort(prompt_mask, axis=1, stable=True)  # left-aligned, as the training forward takes them
    p_ids, p_mask = jnp.take_along_axis(prompt_ids, order, 1), jnp.take_along_axis(prompt_mask, order, 1)
    *_, routing = model.model.forward_shared_prompt(p_ids, p_mask, rollout.completion_ids, rollout.completion_mask)
    own = np.asarray(routing.experts[1, :, p_ids.shape[1]:, 0]).reshape(g * 2, c)  # [N, C]
    recorded = np.asarray(rollout.routes.completion[:, :, 1, 0])  # [N, C]: the sampler's, -1 where never fed
    counted = (np.asarray(rollout.completion_mask) > 0) & (recorded >= 0)
    assert (np.asarray(rollout.routes.completion[:, :, 0]) == -1).all()  # the dense layer records none
    want = float((recorded != own)[counted].sum()) / counted.sum()
    print(f"replay {replay}: {int((recorded != own)[counted].sum())} of {counted.sum()} decisions differ; gap "
          f"mean {metrics['sampling/sampling_logp_difference/mean']:.2e} max "
          f"{metrics['sampling/sampling_logp_difference/max']:.2e}")
    assert 0 < want < 1
    assert metrics["sampling/routing_mismatch"] == pytest.approx(want, rel=1e-6)
    if replay:
        assert metrics["sampling/sampling_logp_difference/max"] <= 1e-5
    else:
        assert metrics["sampling/sampling_logp_difference/mean"] > 1e-3
