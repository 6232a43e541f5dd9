"""The jitted step against a direct composition of the public API (two paths that must agree)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rloo_jax as rj
from rloo_jax.models import init_causal_lm
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import StepConfig, completion_logps

TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
)
EOS, PAD, G, C = 3, 0, 4, 6


@pytest.fixture(scope="module")
def model_parts():
    model = init_causal_lm(TINY, seed=0)
    graphdef, params = nnx.split(model)
    return graphdef, params


def _prompts():
    ids = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], np.int32)
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


def _cfg(**kw):
    sampling = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=kw.pop("temperature", 0.9),
                              eos_token_ids=(EOS,), pad_token_id=PAD)
    step_fields = {k: kw.pop(k) for k in ("num_iterations", "steps_per_generation", "gradient_accumulation_steps")
                   if k in kw}
    return StepConfig(sampling=sampling, algorithm=rj.RLOO(**kw), **step_fields)


def _rewards(rollout):
    # a deterministic reward of the completion: fraction of even tokens, with one None
    ids = np.asarray(rollout.completion_ids)
    r = (ids % 2 == 0).mean(1).astype(np.float32)
    r[1] = np.nan
    return jnp.asarray(r[:, None])


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def test_rollout_logps_match_training_path(model_parts):
    graphdef, params = model_parts
    step = Programs(graphdef, optax.sgd(0.1), _cfg(beta=0.1))
    state = step.init_state(_copy(params), _copy(params))
    ids, mask = _prompts()
    ro = step.rollout(state, ids, mask, jax.random.key(0))
    assert ro.completion_ids.shape == (2 * G, C)
    full = completion_logps(graphdef, params, jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0),
                            ro.completion_ids, ro.completion_mask, 0.9)
    m = np.asarray(ro.completion_mask) > 0
    np.testing.assert_allclose(np.asarray(ro.old_logps)[m], np.asarray(full)[m], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ro.ref_logps)[m], np.asarray(full)[m], atol=1e-5)  # ref == policy
    mask_ref, trunc_ref = rj.completion_mask(ro.completion_ids, (EOS,), PAD)
    np.testing.assert_array_equal(ro.completion_mask, mask_ref)
    np.testing.assert_array_equal(ro.is_truncated, trunc_ref)


def test_update_equals_sgd_on_rloo_loss(model_parts):
    """One on-policy update with SGD == params - lr * grad(rloo_loss(completion_logps(params)))."""
    graphdef, params = model_parts
    cfg = _cfg(beta=0.1)
    step = Programs(graphdef, optax.sgd(0.5), cfg)
    ref_params = jax.tree.map(lambda x: x + 0.01, _copy(params))  # policy != reference: KL is not 0
    state = step.init_state(_copy(params), ref_params)
    ids, mask = _prompts()
    ro = step.rollout(state, ids, mask, jax.random.key(1))
    rewards = _rewards(ro)
    w = jnp.ones(1)
    p_ids, p_mask = jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0)

    def direct_loss(p):
        lp = completion_logps(graphdef, p, p_ids, p_mask, ro.completion_ids, ro.completion_mask, 0.9)
        return rj.rloo_loss(lp, None, ro.ref_logps, rewards, ro.completion_mask, ro.is_truncated,
                            num_generations=G, reward_weights=w, options=cfg.algorithm)

    (loss, want_metrics), grads = jax.value_and_grad(direct_loss, has_aux=True)(params)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    new_state, metrics = step.update(state, ro, rewards, w)
    metrics = flat_metrics(metrics)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert int(new_state.step) == 1
    for name in ("reward", "reward_std", "kl", "advantage_abs_mean", "loss", "clip_ratio/region_mean"):
        assert float(metrics[name]) == pytest.approx(float(want_metrics[name]), abs=1e-5), name
    assert abs(float(metrics["kl"])) > 1e-5
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.global_norm(grads)), rel=1e-4)
    assert 0 < float(metrics["entropy"]) < np.log(40) + 1e-3


def test_gradient_accumulation_equals_full_batch(model_parts):
    """spg = gas = 2 (two micro-batches averaged) gives the same update as one full batch (sequence-mean loss)."""
    graphdef, params = model_parts
    ids, mask = _prompts()
    results = []
    for spg in (1, 2):
        step = Programs(graphdef, optax.sgd(0.5), _cfg(beta=0.0, steps_per_generation=spg,
                                                        gradient_accumulation_steps=spg))
        state = step.init_state(_copy(params))
        ro = step.rollout(state, ids, mask, jax.random.key(2))
        new, _ = step.update(state, ro, _rewards(ro), jnp.ones(1))
        results.append(new.params)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_num_iterations_two_is_two_sequential_ppo_updates(model_parts):
    """The second pass is off-policy: old = generation-time log-probs, ratio != 1 (with clipping)."""
    graphdef, params = model_parts
    cfg = _cfg(beta=0.0, num_iterations=2, epsilon=0.05)
    step = Programs(graphdef, optax.sgd(2.0), cfg)
    state = step.init_state(_copy(params))
    ids, mask = _prompts()
    ro = step.rollout(state, ids, mask, jax.random.key(3))
    rewards = _rewards(ro)
    adv = step.score(ro, rewards, jnp.ones(1))[0]["advantages"]
    p_ids, p_mask = jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0)

    def loss_fn(p):
        lp = completion_logps(graphdef, p, p_ids, p_mask, ro.completion_ids, ro.completion_mask, 0.9)
        return rj.clipped_objective(lp, ro.old_logps, adv, ro.completion_mask, 0.05)

    p = params
    for _ in range(2):
        g = jax.grad(lambda q: loss_fn(q)[0])(p)
        p = jax.tree.map(lambda a, b: a - 2.0 * b, p, g)
    new_state, metrics = step.update(state, ro, rewards, jnp.ones(1))
    metrics = flat_metrics(metrics)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)
    assert int(new_state.step) == 2
    assert float(metrics["ratio_mean"]) != pytest.approx(1.0, abs=1e-7)


def test_update_compiles_once_for_a_fixed_bucket(model_parts):
    graphdef, params = model_parts
    step = Programs(graphdef, optax.adamw(1e-3), _cfg(beta=0.05))
    state = step.init_state(_copy(params), _copy(params))
    rng = np.random.default_rng(0)
    for i in range(3):
        ids = jnp.asarray(rng.integers(4, 40, size=(2, 6)), jnp.int32)
        lens = rng.integers(1, 7, size=2)
        mask = jnp.asarray((np.arange(6)[None] >= 6 - lens[:, None]).astype(np.int32))
        ro = step.rollout(state, ids, mask, jax.random.key(i))
        state, m = step.update(state, ro, _rewards(ro), jnp.ones(1))
        assert np.isfinite(float(m["update"]["loss"][0]))
    assert step.rollout_program(2, 6).fn._cache_size() == 1
    assert step.update_program(2, 6, C, 1).fn._cache_size() == 1


def test_sync_reference_mixup(model_parts):
    graphdef, params = model_parts
    step = Programs(graphdef, optax.sgd(0.1), _cfg(beta=0.1))
    ref = jax.tree.map(jnp.zeros_like, params)
    state = step.init_state(_copy(params), ref)
    new = step.sync_reference(state, 0.25)
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(new.ref_params), strict=True):
        np.testing.assert_allclose(r, 0.25 * np.asarray(p), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ widths
def test_completion_width_goldens():
    assert [rj.completion_width(n, 1024, 128) for n in (0, 1, 128, 129, 300, 513, 1000, 1024)] == [
        128, 128, 128, 256, 512, 1024, 1024, 1024]
    assert rj.completion_width(5, 12, 0) == 12 and rj.completion_width(5, 12, 16) == 12  # off / one width
    assert rj.completion_width(7, 12, 4) == 8 and rj.completion_width(9, 12, 4) == 12  # capped at the max


def early_ending(rollout, ends, eos=EOS, pad=PAD):
    """The rollout with completion r ending (EOS) at position ends[r], pad after: as a sampler would give it."""
    ids = np.asarray(rollout.completion_ids).copy()
    for r, e in enumerate(ends):
        ids[r, e] = eos
        ids[r, e + 1:] = pad
        ids[r, :e] = np.where(ids[r, :e] == eos, eos + 1, ids[r, :e])
    ids = jnp.asarray(ids)
    mask, truncated = rj.completion_mask(ids, (eos,), pad)
    return rollout.replace(completion_ids=ids, completion_mask=mask, is_truncated=truncated,
                           old_logps=rollout.old_logps * mask)


def test_finish_and_update_at_a_bucket_equal_the_full_width(model_parts):
    """Reference pass and update cut to the bucket that holds the longest completion: the same numbers as at
    max_new_tokens (positions beyond are padding, masked everywhere)."""
    graphdef, params = model_parts
    sampling = SamplingConfig(max_new_tokens=16, num_generations=G, temperature=0.9, eos_token_ids=(EOS,),
                              pad_token_id=PAD)
    cfg = StepConfig(sampling=sampling, algorithm=rj.RLOO(beta=0.1), steps_per_generation=2)
    step = Programs(graphdef, optax.sgd(0.5), cfg)  # sgd: parameter changes are the gradients themselves
    ids, mask = _prompts()
    state = step.init_state(_copy(params), _copy(params))
    sampled = early_ending(step.sample(state, ids, mask, jax.random.key(0)), [2, 5, 0, 4, 3, 1, 5, 2])
    assert step.longest(sampled) == 6
    width = rj.completion_width(step.longest(sampled), 16, 4)
    full, cut = step.finish(state, sampled, 16), step.finish(state, sampled, width)
    assert width == 8 and cut.completion_ids.shape == (8, 8)
    np.testing.assert_array_equal(np.asarray(full.ref_logps[:, 8:]), 0)
    # f32 rounding only: attention reduces over 8 vs 16 key positions (max |diff| measured 1.4e-6 on this CPU)
    np.testing.assert_allclose(np.asarray(cut.ref_logps), np.asarray(full.ref_logps[:, :8]), atol=3e-6)
    np.testing.assert_allclose(np.asarray(cut.old_logps), np.asarray(full.old_logps[:, :8]), atol=3e-6)
    np.testing.assert_array_equal(cut.sampler_logps, sampled.old_logps[:, :8])  # spg 2 > gas 1: recomputed
    rewards = _rewards(full)
    out = [step.update(step.init_state(_copy(params), _copy(params)), ro, rewards, jnp.ones((1,))) for ro in
           (full, cut)]
    (s_full, m_full), (s_cut, m_cut) = [(s, flat_metrics(m)) for s, m in out]
    for name, value in m_full.items():
        assert float(m_cut[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-6, nan_ok=True), name
    for a, b in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_cut.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


# ------------------------------------------------------------------------------------------------ sampler vs trainer
GAP = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")


def test_on_policy_gap_metrics_come_from_the_update_forward(model_parts):
    """On-policy, no dropout: nothing is recomputed; the update's forward (at the sampling parameters) measures
    |trainer - sampler| over the real completion tokens. In float32 the two paths agree to rounding."""
    graphdef, params = model_parts
    cfg = _cfg(beta=0.1)
    assert cfg.on_policy and not cfg.recompute
    step = Programs(graphdef, optax.sgd(0.5), cfg)
    state = step.init_state(_copy(params), _copy(params))
    ids, mask = _prompts()
    ro = step.rollout(state, ids, mask, jax.random.key(1))
    assert ro.sampler_logps is None  # old_logps are the sampler's
    metrics = flat_metrics(step.update(_copy(state), ro, _rewards(ro), jnp.ones(1))[1])
    assert 0.0 < float(metrics[GAP[1]]) <= 1e-5  # float32: rounding only (measured 1.7e-6)
    # a sampler off by a known amount: the metrics are its gap to this training forward
    shift = jnp.asarray(np.random.default_rng(0).normal(0.0, 0.05, size=ro.old_logps.shape), jnp.float32)
    ro = ro.replace(old_logps=(ro.old_logps + shift) * ro.completion_mask)
    trained = completion_logps(graphdef, params, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                               ro.completion_mask, 0.9)
    want = rj.sampling_logp_difference(trained * ro.completion_mask, ro.old_logps, ro.completion_mask)
    metrics = flat_metrics(step.update(state, ro, _rewards(ro), jnp.ones(1))[1])
    for name in GAP:
        assert float(metrics[name]) == pytest.approx(float(want[name]), rel=1e-4), name


def test_recomputed_old_logps_are_the_training_forward_and_the_kl_uses_them(model_parts):
    """recompute_old_logps: finish runs the policy's training forward at the sampling parameters beside the
    reference pass; the sampler's log-probs are kept for the gap. With policy == reference the KL is exactly 0."""
    graphdef, params = model_parts
    cfg = dataclasses.replace(_cfg(beta=0.1), recompute_old_logps=True)
    step = Programs(graphdef, optax.sgd(0.5), cfg)
    state = step.init_state(_copy(params), _copy(params))
    ids, mask = _prompts()
    sampled = step.sample(state, ids, mask, jax.random.key(1))
    ro = step.finish(state, sampled, C)
    np.testing.assert_array_equal(ro.sampler_logps, sampled.old_logps)
    trained = completion_logps(graphdef, params, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                               ro.completion_mask, 0.9) * ro.completion_mask
    np.testing.assert_allclose(ro.old_logps, trained, atol=1e-6)
    np.testing.assert_array_equal(ro.old_logps, ro.ref_logps)  # the same forward of the same numbers
    metrics = flat_metrics(step.update(state, ro, _rewards(ro), jnp.ones(1))[1])
    assert float(metrics["kl"]) == 0.0
    want = rj.sampling_logp_difference(ro.old_logps, ro.sampler_logps, ro.completion_mask)
    for name in GAP:
        assert float(metrics[name]) == pytest.approx(float(want[name]), abs=1e-7), name
    assert 0.0 < float(metrics[GAP[1]]) <= 1e-5


def test_importance_sampling_correction_equals_sgd_on_the_weighted_loss(model_parts, mode="sequence_mask"):
    """A sampler whose log-probs are off by a known amount: the update weights each sequence by
    importance_sampling_weights(trainer, sampler) and equals SGD on rloo_loss with those weights."""
    graphdef, params = model_parts
    rloo = rj.RLOO(beta=0.1)
    sampling = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9, eos_token_ids=(EOS,),
                              pad_token_id=PAD)
    step = Programs(graphdef, optax.sgd(0.5), StepConfig(
        sampling=sampling, algorithm=rloo, importance_sampling=rj.ImportanceSampling(mode, 0.9, 1.1)))
    ref_params = jax.tree.map(lambda x: x + 0.01, _copy(params))
    state = step.init_state(_copy(params), ref_params)
    ids, mask = _prompts()
    ro = step.rollout(state, ids, mask, jax.random.key(1))
    shift = jnp.asarray(np.random.default_rng(0).normal(0.0, 0.05, size=ro.old_logps.shape), jnp.float32)
    ro = ro.replace(sampler_logps=(ro.old_logps + shift) * ro.completion_mask)
    weights, want_is = rj.importance_sampling_weights(ro.old_logps, ro.sampler_logps, ro.completion_mask, mode,
                                                      0.9, 1.1)
    bounded = np.isin(np.asarray(weights), np.float32([0.0, 0.9, 1.1]))
    assert 0 < bounded.sum() < len(bounded)  # some sequences clipped or masked, some weighted freely: a real test
    rewards, w = _rewards(ro), jnp.ones(1)
    p_ids, p_mask = jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0)

    def direct_loss(p):
        lp = completion_logps(graphdef, p, p_ids, p_mask, ro.completion_ids, ro.completion_mask, 0.9)
        return rj.rloo_loss(lp, None, ro.ref_logps, rewards, ro.completion_mask, ro.is_truncated,
                            num_generations=G, reward_weights=w, options=rloo, importance_weights=weights)[0]

    grads = jax.grad(direct_loss)(params)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    new_state, metrics = step.update(state, ro, rewards, w)
    metrics = flat_metrics(metrics)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    for name, value in want_is.items():
        assert float(metrics[name]) == pytest.approx(float(value), rel=1e-6), name


def test_old_logps_rule():
    """TRL's rule: recompute off-policy (and with dropout); on-policy the update's forward stands in."""
    assert not _cfg().recompute
    assert _cfg(num_iterations=2).recompute and _cfg(steps_per_generation=2).recompute
    assert not _cfg(steps_per_generation=2, gradient_accumulation_steps=2).recompute
    assert dataclasses.replace(_cfg(), dropout_seed=0).recompute
    assert dataclasses.replace(_cfg(), recompute_old_logps=True).recompute
    with pytest.raises(ValueError, match="off-policy"):
        dataclasses.replace(_cfg(num_iterations=2), recompute_old_logps=False)
