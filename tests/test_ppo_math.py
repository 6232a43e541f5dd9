"""PPO math (rloo_jax.algorithms.ppo): hand goldens, plain-loop oracles, and parity with TRL 1.12's PPOTrainer.

The parity half runs TRL 1.12.0 (the last release with ``PPOTrainer``; the main venv has TRL 1.16) in one
subprocess with ``.venv-trl112`` (``make install-test`` creates it) first on ``sys.path``: this file, run as a script,
is that subprocess. It builds tiny Qwen2 policy / reference / reward / value models, replaces TRL's module-level
``batch_generation`` with fixed completions (their logits from a policy forward, scaled as generation scores are),
seeds NumPy for TRL's shuffles, and records what TRL's own ``train()`` computes -- its rollout locals at the first
``np.random.permutation`` of each update, each micro-batch's locals at ``accelerator.backward``, the raw model
outputs at its ``forward`` / ``get_reward`` calls, the statistics tables and the logged dict -- into an ``.npz``. The
tests feed our functions the same raw logits, value-head outputs and reward logits and compare every tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax.algorithms import ppo
from tests import ppo_oracle as oracle
from tests import ppo_trl112_fields as vendored

ROOT = Path(__file__).resolve().parents[1]
TRL112 = ROOT / ".venv-trl112"

# ----------------------------------------------------------------------------------------------- hand goldens

F, T = False, True


def test_first_true_indices_and_truncate_response():
    np.testing.assert_array_equal(ppo.first_true_indices(jnp.array([[F, T, T], [F, F, F], [T, F, F]])), [1, 3, 0])
    r = jnp.array([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    np.testing.assert_array_equal(ppo.truncate_response(r, 2, 0), [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    np.testing.assert_array_equal(ppo.truncate_response(r, None, 0), r)
    # stop id 0 is honoured (TRL tests `is not None`)
    np.testing.assert_array_equal(ppo.truncate_response(jnp.array([[3, 0, 4]]), 0, 9), [[3, 0, 9]])


def test_forward_inputs():
    ids, mask, pos = oracle.forward_inputs(jnp.array([[0, 5, 6, 0], [3, 0, 4, 5]]), 0)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 0], [3, 0, 4, 5]])
    np.testing.assert_array_equal(mask, [[F, T, T, F], [T, F, T, T]])
    np.testing.assert_array_equal(pos, [[0, 0, 1, 2], [0, 1, 1, 2]])
    ids, _, _ = oracle.forward_inputs(jnp.array([[7, 5, 7]]), 7)  # pad id 7: replaced by 0
    np.testing.assert_array_equal(ids, [[0, 5, 0]])


def test_positions_lengths_and_masks():
    post = jnp.array([[7, 1, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
    np.testing.assert_array_equal(oracle.reward_positions(post, 0, 3), [4, 6, 2])
    lengths = ppo.sequence_lengths(post, 0)
    np.testing.assert_array_equal(lengths, [1, 3, -1])
    np.testing.assert_array_equal(ppo.score_positions(lengths, 4), [2, 3, 0])
    pm, pm1 = ppo.padding_masks(lengths, 4)
    np.testing.assert_array_equal(pm, [[F, F, T, T], [F, F, F, F], [T, T, T, T]])
    np.testing.assert_array_equal(pm1, [[F, F, F, T], [F, F, F, F], [F, T, T, T]])
    pm, pm1 = ppo.padding_masks(jnp.array([2, 0]), 4, 3)  # TRL's tensors 3 wide: column 3 does not exist there
    np.testing.assert_array_equal(pm, [[F, F, F, T], [F, T, T, T]])
    np.testing.assert_array_equal(pm1, [[F, F, F, T], [F, F, T, T]])
    np.testing.assert_array_equal(ppo.score_positions(jnp.array([2, 0]), 3), [2, 1])  # as wide as W: its last token
    r = jnp.array([[5, 2, 0, 0], [2, 0, 0, 0], [5, 5, 2, 9]])
    assert int(ppo.generated_width(r[:2], 2)) == 2 and int(ppo.generated_width(r, 2)) == 3
    assert int(ppo.generated_width(jnp.array([[5, 5, 5, 5], [2, 0, 0, 0]]), 2)) == 4
    assert int(ppo.generated_width(r, None)) == 4
    logits = jnp.arange(2 * 5 * 1, dtype=jnp.float32).reshape(2, 5, 1)
    np.testing.assert_array_equal(oracle.gather_scores(logits, jnp.array([4, 0])), [4.0, 5.0])
    np.testing.assert_array_equal(ppo.response_slice(logits, 3), [[2, 3], [7, 8]])
    assert ppo.response_slice(jnp.zeros((2, 5, 7)), 3).shape == (2, 2, 7)


def test_policy_logprobs_scale_by_temperature_plus_1e7():
    logits = jnp.log(jnp.array([[[0.25, 0.75]]]))
    lp, ent = ppo.policy_logprobs(logits, jnp.array([[1]]), 1.0)
    assert float(lp[0, 0]) == pytest.approx(np.log(0.75), abs=1e-6)  # -0.2877
    assert float(ent[0, 0]) == pytest.approx(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), abs=1e-6)  # 0.5623
    x = jnp.array([[[1.0, 3.0]]])
    lp, _ = ppo.policy_logprobs(x, jnp.array([[0]]), 0.5)
    z = np.array([1.0, 3.0]) / (0.5 + 1e-7)
    assert float(lp[0, 0]) == pytest.approx(z[0] - np.log(np.exp(z).sum()), abs=1e-6)
    np.testing.assert_array_equal(ppo.scale_logits(x, 0.7), x / np.float32(0.7 + 1e-7))


def test_token_kl_and_rewards():
    lp, ref = jnp.log(jnp.array([[0.5, 0.2]])), jnp.log(jnp.array([[0.25, 0.2]]))
    np.testing.assert_allclose(ppo.token_kl(lp, ref, "k1"), [[np.log(2), 0]], atol=1e-6)
    np.testing.assert_allclose(ppo.token_kl(lp, ref, "k3"), [[0.5 - 1 + np.log(2), 0]], atol=1e-6)  # 0.1931
    np.testing.assert_allclose(ppo.token_kl(ref, lp, "k3"), [[2 - 1 - np.log(2), 0]], atol=1e-6)  # 0.3069
    with pytest.raises(ValueError, match="k1"):
        ppo.token_kl(lp, ref, "k2")
    kl = jnp.array([[0.1, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    rewards, nsr = ppo.token_rewards(kl, jnp.array([1.0, 2.0]), jnp.array([1, 3]), 0.5)
    np.testing.assert_allclose(nsr, [[-0.05, -0.1, 0, 0], [-0.05] * 4], atol=1e-7)
    np.testing.assert_allclose(rewards, [[-0.05, -0.1, 1, 0], [-0.05, -0.05, -0.05, 1.95]], atol=1e-7)
    rewards, _ = ppo.token_rewards(kl, jnp.array([1.0, 2.0]), jnp.array([1, 1]), 0.5, response_width=2)
    np.testing.assert_allclose(rewards, [[-0.05, 0.9, 0, 0], [-0.05, 1.95, -0.05, -0.05]], atol=1e-7)
    scores, has_eos = ppo.apply_missing_eos_penalty(jnp.array([1.0, 1.0]), jnp.array([[4, 1], [4, 5]]), 1, 2.0)
    np.testing.assert_allclose(scores, [1.0, -1.0])
    np.testing.assert_array_equal(has_eos, [T, F])
    scores, _ = ppo.apply_missing_eos_penalty(jnp.array([1.0, 1.0]), jnp.array([[4, 1], [4, 5]]), 1, None)
    np.testing.assert_allclose(scores, [1.0, 1.0])


def test_masked_statistics_and_whitening():
    v, m = jnp.array([1.0, 2.0, 3.0, 99.0]), jnp.array([T, T, T, F])
    assert float(ppo.masked_mean(v, m)) == 2.0
    assert float(ppo.masked_var(v, m)) == pytest.approx(1.0)
    assert float(ppo.masked_var(v, m, unbiased=False)) == pytest.approx(2 / 3)
    w = ppo.masked_whiten(v, m)
    np.testing.assert_allclose(w[:3], np.array([-1.0, 0.0, 1.0]) / np.sqrt(1 + 1e-8), atol=1e-6)
    assert float(w[3]) == pytest.approx(97.0, abs=1e-4)  # masked-out entries are transformed too
    np.testing.assert_allclose(ppo.masked_whiten(v, m, shift_mean=False)[:3], [1.0, 2.0, 3.0], atol=1e-6)
    assert np.isnan(float(ppo.masked_mean(v, jnp.zeros(4, bool))))  # TRL's unguarded division


def test_gae_golden():
    adv, ret = ppo.gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.2]]), 1.0, 0.5)
    np.testing.assert_allclose(adv, [[0.1, 0.8]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0.6, 1.0]], atol=1e-6)
    # gamma discounts the bootstrap and the trace: A1 = 1 - 0.2; A0 = 0.9 * 0.2 - 0.5 + 0.9 * 0.5 * 0.8
    adv, _ = ppo.gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.2]]), 0.9, 0.5)
    np.testing.assert_allclose(adv, [[0.18 - 0.5 + 0.36, 0.8]], atol=1e-6)


def test_ppo_loss_golden_and_gradients():
    """B 1, L 3, sequence length 1: token 2 is policy padding but value-valid (padding_mask_p1 keeps it).

    ratio [1.5, 0.9, 1 (pad)], A [1, -1, 0], cliprange 0.2: token 0 clipped, token 1 not -> pg_loss
    (-1.2 + 0.9) / 2 = -0.15, clipfrac 1/2. Values V [0.5, 0.2, 0], R [1, 0, 0.3], vpred [0.9, 0.1, 0.5], clip 0.2:
    vclip [0.7, 0.1, 0.2], max((v-R)^2, (vc-R)^2) = [0.09, 0.01, 0.04] -> vf_loss 0.5 * 0.14 / 3, vf_clipfrac 1/3.
    """
    half = np.log(0.5)
    batch = ppo.PPORollout(
        responses=jnp.array([[3, 4, 0]]), postprocessed_responses=jnp.array([[3, 4, 0]]),
        sequence_lengths=jnp.array([1]), contain_eos_token=jnp.array([F]),
        padding_mask=jnp.array([[F, F, T]]), padding_mask_p1=jnp.array([[F, F, F]]),
        logprobs=jnp.array([[half, half, 1.0]]), ref_logprobs=jnp.zeros((1, 3)),
        values=jnp.array([[0.5, 0.2, 0.0]]), scores=jnp.zeros(1), kl=jnp.zeros((1, 3)),
        non_score_reward=jnp.zeros((1, 3)), rewards=jnp.zeros((1, 3)),
        advantages=jnp.array([[1.0, -1.0, 0.0]]), returns=jnp.array([[1.0, 0.0, 0.3]]),
        response_width=jnp.array([3]),
    )
    opts = ppo.PPOOptions(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    new = jnp.log(jnp.array([[0.75, 0.45, 0.01]]))  # the padded token's value is replaced by INVALID_LOGPROB
    vpred = jnp.array([[0.9, 0.1, 0.5]])
    loss, st = ppo.ppo_loss(new, vpred, batch, opts, entropy=jnp.array([[1.0, 2.0, 3.0]]))
    vf = 0.5 * 0.14 / 3
    assert float(st["pg_loss"]) == pytest.approx(-0.15, abs=1e-6)
    assert float(st["vf_loss"]) == pytest.approx(vf, abs=1e-6)
    assert float(loss) == pytest.approx(-0.15 + 0.1 * vf, abs=1e-6)
    assert float(st["pg_clipfrac"]) == pytest.approx(0.5)
    assert float(st["vf_clipfrac"]) == pytest.approx(1 / 3)
    assert float(st["approxkl"]) == pytest.approx(0.5 * (np.log(1.5) ** 2 + np.log(0.9) ** 2) / 3, abs=1e-6)
    assert float(st["ratio"]) == pytest.approx((1.5 + 0.9 + 1.0) / 3, abs=1e-6)
    assert float(st["entropy"]) == pytest.approx(2.0)
    assert "entropy" not in ppo.ppo_loss(new, vpred, batch, opts)[1]
    # the same row one column wider, with TRL's width 3: the all-position means keep their denominators
    wide = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, 1)], constant_values=1) if x.ndim == 2 else x, batch)
    wide = wide.replace(padding_mask=jnp.array([[F, F, T, T]]), padding_mask_p1=jnp.array([[F, F, F, T]]))
    loss_w, st_w = ppo.ppo_loss(jnp.pad(new, [(0, 0), (0, 1)]), jnp.pad(vpred, [(0, 0), (0, 1)]), wide, opts,
                                entropy=jnp.array([[1.0, 2.0, 3.0, 50.0]]))
    assert float(loss_w) == pytest.approx(float(loss), abs=1e-7)
    for name in ppo.STAT_NAMES:
        assert float(st_w[name]) == pytest.approx(float(st[name]), abs=1e-7), name
    # gradients: none through the clipped token or the padding; the value loss only where unclipped
    g_new, g_v = jax.grad(lambda a, b: ppo.ppo_loss(a, b, batch, opts)[0], argnums=(0, 1))(new, vpred)
    np.testing.assert_allclose(g_new, [[0.0, 0.9 / 2, 0.0]], atol=1e-6)  # d(-A r)/d logp = -A r = 0.9, mean of 2
    np.testing.assert_allclose(g_v, [[0.0, 0.1 * 0.5 * 2 * 0.1 / 3, 0.1 * 0.5 * 2 * 0.2 / 3]], atol=1e-6)


def test_ppo_rollout_hand_example():
    """Two rows, L 3, k1, coef 0.5, gamma 1, lam 1: row 0 ends at t 0 (EOS), row 1 has no EOS (penalty 1)."""
    responses = jnp.array([[1, 0, 0], [4, 5, 6]])
    lp = jnp.log(jnp.array([[0.5, 0.3, 0.3], [0.5, 0.5, 0.5]]))
    ref = jnp.log(jnp.array([[0.25, 0.9, 0.9], [0.5, 0.5, 0.25]]))
    values = jnp.array([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
    opts = ppo.PPOOptions(kl_coef=0.5, gamma=1.0, lam=1.0, missing_eos_penalty=1.0)
    r = ppo.ppo_rollout(responses, responses, lp, ref, values, jnp.array([2.0, 3.0]), eos_token_id=1,
                        pad_token_id=0, options=opts)
    ln2 = np.log(2)
    np.testing.assert_array_equal(r.sequence_lengths, [0, 2])
    np.testing.assert_allclose(r.scores, [2.0, 2.0])
    np.testing.assert_allclose(r.logprobs[0], [np.log(0.5), 1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(r.values, [[0.1, 0.2, 0.0], [0.0, 0.0, 0.0]], atol=1e-7)  # p1 keeps t 1 of row 0
    np.testing.assert_allclose(r.kl, [[ln2, 0, 0], [0, 0, ln2]], atol=1e-6)
    # row 0: score at t 1 (one past the EOS); row 1: at its last token
    np.testing.assert_allclose(r.rewards, [[-0.5 * ln2, 2.0, 0], [0, 0, 2.0 - 0.5 * ln2]], atol=1e-6)
    # gamma = lam = 1: A_t = sum_{s >= t} r_s - V_t; returns = A + V
    a_raw = np.array([[-0.5 * ln2 + 2.0 - 0.1, 2.0 - 0.2, 0.0], [2 - 0.5 * ln2] * 3])
    np.testing.assert_allclose(r.returns, a_raw + np.array([[0.1, 0.2, 0.0], [0, 0, 0]]), atol=1e-6)
    keep = np.array([[T, F, F], [T, T, T]])
    mean, var = a_raw[keep].mean(), a_raw[keep].var(ddof=1)
    np.testing.assert_allclose(r.advantages, np.where(keep, (a_raw - mean) / np.sqrt(var + 1e-8), 0), atol=1e-5)


def test_options_validate_the_estimator():
    from rloo_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="kl_estimator"):
        ppo.PPOOptions(kl_estimator="k2")


# ----------------------------------------------------------------------------------------------- loop oracles


def _gae_loop(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """TRL 1.12's loop, transliterated (ppo_trainer.py 787-795)."""
    last, out = np.zeros(rewards.shape[0]), []
    for t in reversed(range(rewards.shape[1])):
        nextvalues = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    return np.stack(out[::-1], axis=1)


def _whiten_loop(values: np.ndarray, mask: np.ndarray, shift_mean: bool) -> np.ndarray:
    kept = [float(x) for x, m in zip(values.ravel(), mask.ravel(), strict=True) if m]
    mean = sum(kept) / len(kept)
    var = sum((x - mean) ** 2 for x in kept) / (len(kept) - 1)
    out = (values - mean) / np.sqrt(var + 1e-8)
    return out + mean if not shift_mean else out


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.97, 0.9), (0.5, 0.0), (0.9, 1.0)])
def test_gae_matches_trl_loop(gamma, lam):
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(5, 9)).astype(np.float32), rng.normal(size=(5, 9)).astype(np.float32)
    adv, ret = jax.jit(ppo.gae, static_argnums=(2, 3))(jnp.asarray(r), jnp.asarray(v), gamma, lam)
    want = _gae_loop(r.astype(np.float64), v.astype(np.float64), gamma, lam)
    np.testing.assert_allclose(adv, want, atol=1e-5)  # measured ~1e-6 (float32 vs float64)
    np.testing.assert_allclose(ret, want + v, atol=1e-5)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(shift_mean):
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 3.0, size=(4, 7)).astype(np.float32)
    mask = rng.random((4, 7)) < 0.6
    got = ppo.masked_whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean)
    np.testing.assert_allclose(got, _whiten_loop(x.astype(np.float64), mask, shift_mean), atol=1e-5)


# ----------------------------------------------------------------------------------------------- batching goldens


def test_batch_sizes_and_errors():
    from rloo_jax.errors import ConfigError

    s = oracle.ppo_batch_sizes(2, 4, 2, 16, total_episodes=16)
    assert (s.local_batch_size, s.batch_size, s.local_mini_batch_size, s.micro_batch_size) == (8, 8, 4, 2)
    assert s.num_total_batches == 2
    s = oracle.ppo_batch_sizes(4, 3, 2, 10, num_train_epochs=2.5, world_size=2)
    assert (s.total_episodes, s.batch_size, s.mini_batch_size, s.num_total_batches) == (25, 24, 12, 2)
    with pytest.raises(ConfigError, match="num_mini_batches"):
        oracle.ppo_batch_sizes(2, 4, 3, 16)
    with pytest.raises(ConfigError, match="whiten_rewards"):
        oracle.ppo_batch_sizes(2, 4, 2, 16, whiten_rewards=True)


def test_minibatch_plan_sync_plan_and_lr():
    plan = oracle.minibatch_plan([3, 0, 2, 1], 2, 1)
    assert [(m, a, r.tolist()) for m, a, r in plan] == [(0, 0, [3]), (0, 1, [0]), (1, 0, [2]), (1, 1, [1])]
    plan = oracle.minibatch_plan(np.arange(12)[::-1], 6, 4)  # ragged: 4 + 2 rows per mini-batch
    assert [(m, a, r.tolist()) for m, a, r in plan] == [
        (0, 0, [11, 10, 9, 8]), (0, 1, [7, 6]), (1, 0, [5, 4, 3, 2]), (1, 1, [1, 0])]
    plan = oracle.minibatch_plan([1, 0], 1, 2)  # mini-batch smaller than a micro-batch: one micro-batch of 1
    assert [(m, a, r.tolist()) for m, a, r in plan] == [(0, 0, [1]), (1, 0, [0])]
    assert oracle.accumulation_sync_plan(8, 4, 0, False) == ([F, F, F, T, F, F, F, T], 8)
    assert oracle.accumulation_sync_plan(3, 4, 8, True) == ([T, T, T], 0)
    assert oracle.accumulation_sync_plan(3, 2, 1, False) == ([T, F, T], 4)
    rng = np.random.RandomState(5)
    want = [rng.permutation(6) for _ in range(6)]
    np.testing.assert_array_equal(oracle.numpy_permutations(5, 6, 3, 2).reshape(6, 6), want)
    assert oracle.linear_lr(1, 3e-3, 2) == 3e-3 and oracle.linear_lr(2, 3e-3, 2) == pytest.approx(1.5e-3)
    assert [oracle.linear_lr(u, 1.0, 5, 2) for u in range(1, 7)] == pytest.approx([0, 0.5, 1.0, 2 / 3, 1 / 3, 0])


def test_stats_table_and_update_metrics_golden():
    stats = [{n: jnp.float32(i + 1) for n in ppo.STAT_NAMES} for i in range(2)]
    tables = oracle.micro_stats_table(stats, [(0, 0, 0), (0, 1, 0)], 1, 2, 2)
    np.testing.assert_array_equal(tables["ratio"], [[[1, 0], [2, 0]]])  # unwritten entries stay 0
    roll = ppo.PPORollout(
        responses=jnp.array([[1, 1, 0], [4, 1, 1]]), postprocessed_responses=jnp.zeros((2, 3), jnp.int32),
        sequence_lengths=jnp.array([0, 2]), contain_eos_token=jnp.array([T, T]),
        padding_mask=jnp.array([[F, T, T], [F, F, F]]), padding_mask_p1=jnp.zeros((2, 3), bool),
        logprobs=jnp.array([[-1.0, 1.0, 1.0], [-2.0, -3.0, -4.0]]), ref_logprobs=jnp.zeros((2, 3)),
        values=jnp.zeros((2, 3)), scores=jnp.array([1.0, 2.0]), kl=jnp.array([[0.5, 0, 0], [0.1, 0.2, 0.3]]),
        non_score_reward=jnp.array([[-0.1, 0, 0], [-0.2, 0, 0]]), rewards=jnp.zeros((2, 3)),
        advantages=jnp.zeros((2, 3)), returns=jnp.zeros((2, 3)), response_width=jnp.array([3, 3]),
    )
    m = oracle.update_metrics(roll, tables, eos_token_id=1, lr=0.5, episode=16)
    assert float(m["objective/kl"]) == pytest.approx((0.5 + 0.6) / 2)
    assert float(m["objective/entropy"]) == pytest.approx((1 + 9) / 2)  # padding's INVALID_LOGPROB left out
    assert float(m["objective/non_score_reward"]) == pytest.approx(-0.15)
    assert float(m["objective/scores"]) == pytest.approx(1.5)
    assert float(m["objective/rlhf_reward"]) == pytest.approx(1.35)
    assert float(m["val/ratio"]) == pytest.approx(0.75)  # (1 + 0 + 2 + 0) / 4
    assert float(m["val/ratio_var"]) == pytest.approx(np.var([1, 0, 2, 0], ddof=1))
    assert float(m["loss/policy_avg"]) == pytest.approx(0.75)
    assert int(m["val/num_eos_tokens"]) == 4 and int(m["episode"]) == 16 and float(m["lr"]) == 0.5


# ----------------------------------------------------------------------------------------------- the TRL 1.12 run

VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(46)]
PAD, EOS, STOP = 0, 1, 7  # STOP: a word token used as stop_token_id
L = 6  # response_length
N_PROMPTS = 16
SEED = 1234  # np.random.seed before train(): TRL's permutations


def _completions(case_seed: int, rows: int, short_update: int | None = None) -> np.ndarray:
    """[2 updates, rows, L] fixed completions covering every response shape TRL handles differently.

    ``short_update``: in that update every row stops (EOS) by position 3, one exactly there, as generation that
    stops early returns them: TRL's tensors are then 4 wide, not L.
    """
    rng = np.random.default_rng(case_seed)
    c = rng.integers(8, 48, size=(2, rows, L))  # word tokens other than STOP
    shapes = [
        [None, None, EOS, PAD, PAD, PAD],  # EOS then padding: score one past the EOS
        [None, None, None, None, EOS, None],  # EOS then more tokens (no stop token: nothing is cut)
        [None] * L,  # full length, no EOS: missing_eos_penalty, score at the last token
        [None, STOP, None, None, EOS, None],  # stop token mid-way: cut there when stop_token_id = STOP
        [None, None, None, None, None, EOS],  # EOS at the last position
        [EOS, PAD, PAD, PAD, PAD, PAD],  # EOS first
        [PAD] * L,  # empty response: sequence length -1
        [None, None, None, EOS, PAD, PAD],
        [None, None, STOP, EOS, None, None],
        [None, None, None, None, STOP, None],
        [None, None, EOS, PAD, PAD, PAD],
        [None, None, None, None, None, None],
    ]
    for u in range(2):
        order = rng.permutation(len(shapes))
        for r in range(rows):
            for t, tok in enumerate(shapes[order[r % len(shapes)]]):
                if tok is not None:
                    c[u, r, t] = tok
    if short_update is not None:
        ends = [3] + [int(e) for e in rng.integers(0, 4, size=rows - 1)]
        for r, e in enumerate(ends):
            c[short_update, r, e] = EOS
            c[short_update, r, e + 1 :] = PAD
    return c


# Each case is one PPOTrainer run of 2 updates. TRL asserts local_mini_batch_size >= 8 under whiten_rewards.
CASES = {
    "k1_minibatches": dict(
        cfg=dict(kl_estimator="k1", per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=2,
                 num_ppo_epochs=2, cliprange=0.2, cliprange_value=0.05, vf_coef=0.1, gamma=0.97, lam=0.9),
        completions_seed=0,
    ),
    "k3_whiten_stop_penalty": dict(
        cfg=dict(kl_estimator="k3", per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=1,
                 num_ppo_epochs=2, whiten_rewards=True, missing_eos_penalty=1.5, stop_token_id=STOP, cliprange=0.1,
                 cliprange_value=0.1, vf_coef=0.3, gamma=1.0, lam=0.95),
        completions_seed=1,
    ),
    "k1_stop_eos_ragged": dict(
        cfg=dict(kl_estimator="k1", per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2,
                 num_ppo_epochs=2, stop_token="eos", missing_eos_penalty=0.5, cliprange=0.15, cliprange_value=0.1,
                 gamma=0.9, lam=0.8),
        completions_seed=2,
        short_update=1,  # generation "stopped early": TRL's tensors are 4 wide in update 1
    ),
}
COMMON = dict(local_rollout_forward_batch_size=3, response_length=L, temperature=0.7, kl_coef=0.2,
              learning_rate=3e-3, seed=0)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(2, 48, size=rng.integers(2, 5)).tolist() for _ in range(N_PROMPTS)]


def _type_str(t: object) -> str:
    """``int | None``, ``Literal['k1', 'k3']``, ``PreTrainedModel``: type names without their modules."""
    import re

    return t.__name__ if isinstance(t, type) else re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", str(t))


def _default_str(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "<required>"


def _trl112_fields() -> dict:
    """PPOConfig's own and TRL's base-config fields, PPOTrainer's constructor, and the ``args.X`` the trainer reads."""
    import inspect
    import re

    import trl.experimental.ppo.ppo_trainer as P
    from trl import ModelConfig, ScriptArguments
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.trainer.base_config import _BaseConfig

    def own(cls: type) -> list:
        names = set(cls.__dict__.get("__annotations__", {}))
        return [[f.name, _type_str(f.type), _default_str(f)] for f in dataclasses.fields(cls) if f.name in names]

    params = [[p.name, _type_str(p.annotation), "<required>" if p.default is p.empty else repr(p.default)]
              for p in inspect.signature(PPOTrainer.__init__).parameters.values() if p.name != "self"]
    reads = sorted(set(re.findall(r"\bargs\.(\w+)", inspect.getsource(P))))
    return dict(ppo_config=own(PPOConfig), base_config=own(_BaseConfig), trainer_init=params, args_read=reads,
                model_config=[f.name for f in dataclasses.fields(ModelConfig)],
                script_arguments=[f.name for f in dataclasses.fields(ScriptArguments)])


def _trl112_driver(out_dir: str) -> None:
    """Runs in the subprocess (TRL 1.12 first on sys.path): every case, recorded into out_dir/trl112_ppo.npz|json."""
    import torch
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert trl.__version__ == "1.12.0", (trl.__version__, trl.__file__)
    torch.set_num_threads(1)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    prompts = _prompts()
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"fields": _trl112_fields(), "cases": {}}
    for case, spec in CASES.items():
        meta["cases"][case] = _trl112_case(case, spec, out_dir, tokenizer, prompts, arrays)
    np.savez(os.path.join(out_dir, "trl112_ppo.npz"), **arrays)
    with open(os.path.join(out_dir, "trl112_ppo.json"), "w") as f:
        json.dump(meta, f)


def _trl112_case(case: str, spec: dict, out_dir: str, tokenizer: object, prompts: list, arrays: dict) -> dict:
    """One PPOTrainer run of 2 updates with fixed completions; its tensors go into ``arrays``, the rest returned."""
    import types

    import torch
    import trl.experimental.ppo.ppo_trainer as P
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    def qwen2(cls: type, seed: int, **kw: object) -> torch.nn.Module:
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=0.2, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=False, **kw)
        return cls(cfg)

    def put(key: str, t: torch.Tensor) -> None:
        t = t.detach()
        arrays[f"{case}/{key}"] = (t.float() if t.dtype.is_floating_point else t).numpy().copy()

    # bf16 left at its default (True): TRL 1.12's PPO builds its own Accelerator without it, so it runs in float32
    args = PPOConfig(output_dir=os.path.join(out_dir, case), total_episodes=N_PROMPTS, report_to=[], use_cpu=True,
                     num_sample_generations=0, save_strategy="no", logging_steps=1, disable_tqdm=True, **COMMON,
                     **spec["cfg"])
    completions = _completions(spec["completions_seed"], args.per_device_train_batch_size
                               * args.gradient_accumulation_steps, spec.get("short_update"))
    arrays[f"{case}/completions"] = completions
    policy, ref = qwen2(Qwen2ForCausalLM, 0), qwen2(Qwen2ForCausalLM, 0)
    with torch.no_grad():  # the reference: the policy, perturbed (so the KL is non-zero from the first update)
        gen = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    reward_model = qwen2(Qwen2ForSequenceClassification, 2, num_labels=1)
    value_model = qwen2(Qwen2ForSequenceClassification, 3, num_labels=1)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward_model, value_model=value_model,
                         train_dataset=Dataset.from_dict({"input_ids": prompts}))
    accelerator = trainer.accelerator
    opt = trainer.optimizer.optimizer
    info: dict = {"micro": [], "perms": [], "logs": [], "optimizer_steps": [], "accelerate_step": []}
    info["sizes"] = {k: getattr(args, k) for k in ("local_batch_size", "batch_size", "mini_batch_size",
                                                     "local_mini_batch_size", "micro_batch_size",
                                                     "num_total_batches", "world_size", "total_episodes")}
    info["optimizer"] = dict(
        type=type(opt).__name__, fused=opt.defaults.get("fused"), betas=list(opt.defaults["betas"]),
        eps=opt.defaults["eps"], groups=[dict(n=len(g["params"]), weight_decay=g["weight_decay"], lr=g["lr"])
                                         for g in opt.param_groups],
        n_params=sum(p.numel() for g in opt.param_groups for p in g["params"]),
        policy_params=sum(p.numel() for p in policy.parameters()),
        value_params=sum(p.numel() for p in value_model.parameters()),
        scheduler=type(trainer.lr_scheduler).__name__,
    )
    info["gradient_checkpointing"] = bool(policy.is_gradient_checkpointing)
    info["mixed_precision"] = str(accelerator.mixed_precision)
    info["bf16"] = args.bf16
    rec: dict = {"update": 0, "micro": 0, "chunks": {}}
    orig_forward, orig_get_reward, orig_permutation = P.forward, P.get_reward, np.random.permutation
    orig_backward, orig_log, orig_step = accelerator.backward, trainer.log, opt.step

    def chunk(name: str, t: torch.Tensor) -> None:
        rec["chunks"].setdefault(name, []).append(t.detach().clone())

    def fake_batch_generation(model, queries, batch_size, pad_token_id, generation_config):
        u = rec["update"]
        responses = completions[u]
        if trainer.stop_token_id is not None:  # generate() stops once every row has produced the stop token
            stops = [list(row).index(trainer.stop_token_id) + 1 if trainer.stop_token_id in row else L
                     for row in responses]
            responses = responses[:, : max(stops)]
        query_responses = torch.cat([queries, torch.as_tensor(responses, dtype=queries.dtype)], 1)
        raw = orig_forward(model, query_responses, pad_token_id).logits[:, queries.shape[1] - 1 : -1]
        put(f"u{u}/gen_raw_logits", raw)
        # what generate() returns as scores: the logits after its temperature warper (temperature + 1e-7)
        return query_responses, raw / generation_config.temperature

    def forward(model, query_responses, pad_token_id):
        out = orig_forward(model, query_responses, pad_token_id)
        if isinstance(out, tuple):  # the policy+value wrapper, in the training loop (raw, before TRL scales it)
            put(f"u{rec['update']}/mb{rec['micro']}/logits", out[0].logits)
            put(f"u{rec['update']}/mb{rec['micro']}/vpred_temp", out[1])
        else:  # the reference policy, per rollout chunk
            chunk("ref_logits", out.logits)
        return out

    def get_reward(model, query_responses, pad_token_id, context_length):
        out = orig_get_reward(model, query_responses, pad_token_id, context_length)
        name = "value" if model is value_model else "reward"
        chunk(f"{name}_logits", out[0])
        chunk(f"{name}_score", out[1])
        return out

    def permutation(n):
        perm = orig_permutation(n)
        frame = sys._getframe(1)
        if frame.f_code.co_name == "train":  # TRL's per-epoch shuffle: the rollout is complete
            loc = frame.f_locals
            u = rec["update"]
            info["perms"].append(perm.tolist())
            if loc["ppo_epoch_idx"] == 0:
                info["context_length"] = int(loc["context_length"])
                for name in ("query_responses", "responses", "postprocessed_responses", "logprobs", "ref_logprobs",
                             "values", "scores", "sequence_lengths", "contain_eos_token", "padding_mask",
                             "padding_mask_p1", "kl", "non_score_reward", "rewards", "advantages", "returns"):
                    put(f"u{u}/{name}", loc[name])
                for name, parts in rec["chunks"].items():
                    put(f"u{u}/{name}", torch.cat(parts, 0))
                rec["chunks"] = {}
        return perm

    def backward(loss, **kwargs):
        loc = sys._getframe(1).f_locals
        for name in ("pg_loss", "vf_loss", "vf_clipfrac", "loss"):
            put(f"u{rec['update']}/mb{rec['micro']}/{name}", loc[name])
        info["micro"].append(dict(
            update=rec["update"], epoch=loc["ppo_epoch_idx"], minibatch=loc["minibatch_idx"],
            ga=loc["gradient_accumulation_idx"], rows=[int(i) for i in loc["micro_batch_inds"]],
            sync=bool(accelerator.sync_gradients), end_of_dataloader=bool(accelerator.gradient_state.end_of_dataloader),
        ))
        rec["micro"] += 1
        return orig_backward(loss, **kwargs)

    def optimizer_step(*a, **kw):
        info["optimizer_steps"].append(rec["update"])
        return orig_step(*a, **kw)

    def log(metrics, *a, **kw):
        loc = sys._getframe(1).f_locals
        for name in ppo.STAT_NAMES:
            put(f"u{rec['update']}/stats/{name}", loc[f"{name}_stats"])
        info["logs"].append({k: float(v) for k, v in metrics.items()})
        info["accelerate_step"].append(accelerator.step)
        out = orig_log(metrics, *a, **kw)
        info["logs"][-1].update(trainer.state.log_history[-1])  # + epoch, step
        rec["update"] += 1
        rec["micro"] = 0
        return out

    P.batch_generation, P.forward, P.get_reward = fake_batch_generation, forward, get_reward
    P.gc = types.SimpleNamespace(collect=lambda: 0)  # TRL collects garbage 3x per update: ~1 s each here
    np.random.permutation = permutation
    accelerator.backward, trainer.log, opt.step = backward, log, optimizer_step
    try:
        np.random.seed(SEED)
        trainer.train()
    finally:
        np.random.permutation = orig_permutation
        P.forward, P.get_reward = orig_forward, orig_get_reward
    return info


# ----------------------------------------------------------------------------------------------- parity tests


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """TRL 1.12's PPOTrainer on every case, once per module (one subprocess, ~15 s)."""
    if not (TRL112 / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        pytest.skip(f"TRL 1.12 side folder {TRL112} is absent: run `make install-test` (or `pip install --no-deps "
                    f"--target {TRL112} trl==1.12.0`)")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("trl112_ppo")
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1",
               PYTHONPATH=os.pathsep.join([str(TRL112), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out / "trl112_ppo.json") as f:
        meta = json.load(f)
    return dict(np.load(out / "trl112_ppo.npz")), meta


def _options(cfg: dict) -> ppo.PPOOptions:
    names = {f.name for f in dataclasses.fields(ppo.PPOOptions)}
    return ppo.PPOOptions(**{k: v for k, v in {**COMMON, **cfg}.items() if k in names})


def _stop_token_id(cfg: dict) -> int | None:
    return EOS if cfg.get("stop_token") == "eos" else cfg.get("stop_token_id")


def _close(ours, theirs, name, atol=1e-5, rtol=1e-4):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), atol=atol, rtol=rtol,
                               err_msg=name)


def _widen(x: np.ndarray, extra: int, value: int | float = 0) -> jnp.ndarray:
    """Pad axis 1 at the end: TRL's W-wide tensors to our fixed L."""
    return jnp.asarray(np.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value))


@functools.partial(jax.jit, static_argnames=("ctx", "stop_token_id", "options"))
def _rollout_from_outputs(responses, reward_logits, value_logits, gen_raw_logits, ref_logits, *, ctx, stop_token_id,
                          options):
    """Our rollout (L wide) from TRL's raw model outputs: generation logits, reference logits, value and reward
    heads, and the width TRL's generation had."""
    width = ppo.generated_width(responses, stop_token_id)
    post = ppo.truncate_response(responses, stop_token_id, PAD)
    scores = oracle.gather_scores(reward_logits, oracle.reward_positions(post, PAD, ctx))
    values = ppo.response_slice(value_logits, ctx)
    logprobs, _ = ppo.policy_logprobs(gen_raw_logits, responses, COMMON["temperature"])
    ref_logprobs, _ = ppo.policy_logprobs(ppo.response_slice(ref_logits, ctx), responses, COMMON["temperature"])
    roll = ppo.ppo_rollout(responses, post, logprobs, ref_logprobs, values, scores, eos_token_id=EOS,
                           pad_token_id=PAD, options=options, response_width=width)
    return roll, scores, values


_ROLLOUTS: dict = {}


def _our_rollout(z: dict, case: str, u: int, ctx: int) -> tuple[ppo.PPORollout, dict]:
    if (id(z), case, u) not in _ROLLOUTS:
        cfg = CASES[case]["cfg"]
        k = f"{case}/u{u}"
        extra = L - z[f"{k}/responses"].shape[1]
        roll, scores, values = _rollout_from_outputs(
            _widen(z[f"{k}/responses"], extra, PAD),
            *(_widen(z[f"{k}/{n}"], extra) for n in ("reward_logits", "value_logits", "gen_raw_logits", "ref_logits")),
            ctx=ctx, stop_token_id=_stop_token_id(cfg), options=_options(cfg),
        )
        _ROLLOUTS[id(z), case, u] = roll, dict(raw_scores=scores, raw_values=values)
    return _ROLLOUTS[id(z), case, u]


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_rollout_matches_trl112(case, trl_run):
    """Truncation, masks, scores, values, KL, rewards (whitened or not), GAE, returns, advantages: TRL's tensors."""
    z, meta = trl_run
    ctx = meta["cases"][case]["context_length"]
    for u in range(2):
        k = f"{case}/u{u}"
        w = z[f"{k}/responses"].shape[1]  # TRL's width: < L where every row stopped early
        np.testing.assert_array_equal(z[f"{k}/responses"], z[f"{case}/completions"][u][:, :w])
        roll, raw = _our_rollout(z, case, u, ctx)
        assert (roll.response_width == w).all()
        _close(raw["raw_scores"], z[f"{k}/reward_score"], "reward score at reward_positions")
        _close(raw["raw_values"][:, :w], z[f"{k}/value_logits"][:, ctx - 1 : -1, 0], "values")
        for name in ("sequence_lengths", "contain_eos_token"):
            np.testing.assert_array_equal(getattr(roll, name), z[f"{k}/{name}"], err_msg=name)
        for name in ("postprocessed_responses", "padding_mask", "padding_mask_p1"):
            np.testing.assert_array_equal(getattr(roll, name)[:, :w], z[f"{k}/{name}"], err_msg=name)
        assert roll.padding_mask[:, w:].all() and roll.padding_mask_p1[:, w:].all()
        _close(roll.scores, z[f"{k}/scores"], f"{k}/scores")
        for name in ("logprobs", "ref_logprobs", "values", "kl", "non_score_reward", "rewards", "returns",
                     "advantages"):
            _close(getattr(roll, name)[:, :w], z[f"{k}/{name}"], f"{k}/{name}")
            if name not in ("logprobs", "ref_logprobs"):  # beyond W: nothing (log-probs hold INVALID_LOGPROB)
                assert not np.asarray(getattr(roll, name))[:, w:].any(), name


@pytest.mark.parity
def test_cases_exercise_every_branch(trl_run):
    """The parity cases really cut at stop tokens, penalise missing EOS, hold empty and full-length responses."""
    z, _ = trl_run
    for case in ("k3_whiten_stop_penalty", "k1_stop_eos_ragged"):
        for u in range(2):
            if u == CASES[case].get("short_update"):
                continue
            k = f"{case}/u{u}"
            assert (z[f"{k}/postprocessed_responses"] != z[f"{k}/responses"]).any(axis=1).sum() >= 2, k
            assert (~z[f"{k}/contain_eos_token"]).sum() >= 2, k
            penalty = CASES[case]["cfg"]["missing_eos_penalty"]
            _close(z[f"{k}/scores"], z[f"{k}/reward_score"] - penalty * ~z[f"{k}/contain_eos_token"], k)
    lengths = np.concatenate([z[f"{c}/u{u}/sequence_lengths"] for c in CASES for u in range(2)])
    assert {-1, 0, L - 1} <= set(lengths.tolist())
    # the early-stopped update: TRL's tensors 4 wide, one row as wide (its score on its last token, not one past)
    k = "k1_stop_eos_ragged/u1"
    assert z[f"{k}/responses"].shape[1] == 4 and (z[f"{k}/sequence_lengths"] == 3).any()


@functools.partial(jax.jit, static_argnames=("ctx", "options"))
def _micro_loss(logits, vpred_temp, batch, *, ctx, options):
    """TRL's W-wide training-forward outputs, padded to L (the extra columns are what a fixed-width model sees)."""
    new_logprobs, entropy = ppo.policy_logprobs(ppo.response_slice(logits, ctx), batch.responses,
                                                COMMON["temperature"])
    return ppo.ppo_loss(new_logprobs, ppo.response_slice(vpred_temp, ctx), batch, options, entropy)


def _micro_batches(z: dict, meta: dict, case: str, u: int):
    """Each TRL micro-batch of update u with our loss on TRL's raw training-forward outputs."""
    cfg = CASES[case]["cfg"]
    ctx = meta["cases"][case]["context_length"]
    roll, _ = _our_rollout(z, case, u, ctx)
    micro = [m for m in meta["cases"][case]["micro"] if m["update"] == u]
    for j, m in enumerate(micro):
        k = f"{case}/u{u}/mb{j}"
        batch = jax.tree.map(lambda x: x[np.asarray(m["rows"])], roll)  # noqa: B023
        extra = ctx + L - z[f"{k}/logits"].shape[1]
        loss, stats = _micro_loss(_widen(z[f"{k}/logits"], extra), _widen(z[f"{k}/vpred_temp"], extra), batch,
                                  ctx=ctx, options=_options(cfg))
        yield k, m, loss, stats, roll


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_minibatch_losses_match_trl112(case, trl_run):
    """Every micro-batch's loss, pg/vf losses, clip fractions, approxkl, entropy and ratio, as TRL computed them."""
    z, meta = trl_run
    for u in range(2):
        for k, m, loss, stats, _ in _micro_batches(z, meta, case, u):
            _close(loss, z[f"{k}/loss"], f"{k}/loss")
            for name in ("pg_loss", "vf_loss", "vf_clipfrac"):
                _close(stats[name], z[f"{k}/{name}"], f"{k}/{name}")
            for name in ppo.STAT_NAMES:  # the rest only live in TRL's tables
                table = z[f"{case}/u{u}/stats/{name}"]
                _close(stats[name], table[m["epoch"], m["minibatch"], m["ga"]], f"{k}/stats/{name}")


@pytest.mark.parity
def test_clipping_fires_in_the_parity_cases(trl_run):
    """Off-policy epochs: ratios away from 1, policy and value clipping both active (else the loss test is weak)."""
    z, _ = trl_run
    for case in CASES:
        for name in ("pg_clipfrac", "vf_clipfrac"):
            assert max(z[f"{case}/u{u}/stats/{name}"].max() for u in range(2)) > 0.1, (case, name)
        ratios = np.stack([z[f"{case}/u{u}/stats/ratio"] for u in range(2)])
        assert np.abs(ratios[ratios != 0] - 1).max() > 0.05, case


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_update_metrics_match_trl112_logs(case, trl_run):
    """The logged dict of each update: our statistics tables (zeros included) and update_metrics vs TRL's log."""
    z, meta = trl_run
    info = meta["cases"][case]
    cfg = {**COMMON, **CASES[case]["cfg"]}
    sizes = info["sizes"]
    E, M, A = cfg["num_ppo_epochs"], cfg["num_mini_batches"], cfg["gradient_accumulation_steps"]
    for u in range(2):
        stats, positions = [], []
        for _, m, _, st, _ in _micro_batches(z, meta, case, u):
            stats.append(st)
            positions.append((m["epoch"], m["minibatch"], m["ga"]))
        roll, _ = _our_rollout(z, case, u, info["context_length"])
        tables = oracle.micro_stats_table(stats, positions, E, M, A)
        for name in ppo.STAT_NAMES:
            _close(tables[name], z[f"{case}/u{u}/stats/{name}"], f"{case}/u{u}/stats/{name}")
        lr = oracle.linear_lr(u + 1, cfg["learning_rate"], sizes["num_total_batches"])
        ours = oracle.update_metrics(roll, tables, eos_token_id=EOS, lr=lr, episode=(u + 1) * sizes["batch_size"])
        log = info["logs"][u]
        assert set(ours) == set(log) - {"eps", "epoch", "step"}
        for name, value in ours.items():
            _close(value, log[name], f"{case}/u{u}/{name}")
        assert log["step"] == u + 1 and log["epoch"] == pytest.approx(log["episode"] / N_PROMPTS)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_batching_matches_trl112(case, trl_run):
    """Sizes, NumPy shuffles, mini/micro-batch rows and positions, and which micro-batches step the optimizer."""
    _, meta = trl_run
    info = meta["cases"][case]
    cfg = {**COMMON, **CASES[case]["cfg"]}
    sizes = oracle.ppo_batch_sizes(cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"],
                                cfg["num_mini_batches"], N_PROMPTS, total_episodes=N_PROMPTS,
                                whiten_rewards=cfg.get("whiten_rewards", False))
    assert dataclasses.asdict(sizes) == info["sizes"]
    perms = oracle.numpy_permutations(SEED, sizes.local_batch_size, cfg["num_ppo_epochs"], 2)
    assert perms.reshape(-1, sizes.local_batch_size).tolist() == info["perms"]
    step = 0
    for u in range(2):
        micro = [m for m in info["micro"] if m["update"] == u]
        plan = [(e, mb, a, rows.tolist()) for e in range(cfg["num_ppo_epochs"])
                for mb, a, rows in oracle.minibatch_plan(perms[u, e], sizes.local_mini_batch_size,
                                                      cfg["per_device_train_batch_size"])]
        assert plan == [(m["epoch"], m["minibatch"], m["ga"], m["rows"]) for m in micro]
        end = (u + 1) % (N_PROMPTS // sizes.local_batch_size) == 0  # drew the dataset's last full batch
        assert all(m["end_of_dataloader"] == end for m in micro)
        syncs, step = oracle.accumulation_sync_plan(len(micro), cfg["gradient_accumulation_steps"], step, end)
        assert syncs == [m["sync"] for m in micro]
        assert step == info["accelerate_step"][u]
        assert sum(syncs) == info["optimizer_steps"].count(u)


@pytest.mark.parity
def test_vendored_trl112_fields_match_the_release(trl_run):
    """tests/ppo_trl112_fields.py equals TRL 1.12.0's PPOConfig, base config, constructor, reads."""
    _, meta = trl_run
    fields = meta["fields"]
    assert vendored.TRL_VERSION == "1.12.0"
    assert {r[0]: tuple(r) for r in fields["ppo_config"]} == {r[0]: r for r in vendored.PPO_CONFIG_FIELDS}
    assert {r[0]: tuple(r) for r in fields["base_config"]} == {r[0]: r for r in vendored.BASE_CONFIG_FIELDS}
    assert [tuple(r) for r in fields["trainer_init"]] == list(vendored.PPO_TRAINER_INIT)
    assert tuple(fields["args_read"]) == vendored.ARGS_READ
    assert tuple(fields["model_config"]) == vendored.MODEL_CONFIG_FIELDS
    assert tuple(fields["script_arguments"]) == vendored.SCRIPT_ARGUMENTS_FIELDS
    # every PPO knob of our options is a TRL field with the same default
    defaults = {name: default for name, _, default in vendored.PPO_CONFIG_FIELDS}
    for f in dataclasses.fields(ppo.PPOOptions):
        assert defaults[f.name] == repr(f.default), f.name


@pytest.mark.parity
def test_trl112_setup_facts(trl_run):
    """Facts docs/ppo.md states about TRL 1.12's setup, as observed in the run."""
    _, meta = trl_run
    for info in meta["cases"].values():
        opt = info["optimizer"]
        # one AdamW over the policy and the value model (backbone + head); no weight decay by default
        assert opt["type"] == "AdamW" and opt["n_params"] == opt["policy_params"] + opt["value_params"]
        assert {g["weight_decay"] for g in opt["groups"]} == {0.0} and opt["betas"] == [0.9, 0.999]
        assert opt["eps"] == 1e-8 and opt["scheduler"] == "LambdaLR"
        assert info["gradient_checkpointing"] is False  # PPOConfig.gradient_checkpointing=True is never applied
        assert info["bf16"] is True and info["mixed_precision"] == "no"  # bf16=True is ignored: float32 throughout


def _trl_prompt_order(seed: int, n: int, local_batch_size: int, updates: int) -> list[list[int]]:
    """The dataset rows TRL 1.12 feeds each update (one process, no sampling RNG used between passes).

    Each pass over the dataset: ``torch.DataLoader`` draws a base seed from the global torch RNG, then its
    ``RandomSampler`` draws one more and shuffles with ``torch.randperm(n, Generator().manual_seed(that))``;
    ``drop_last`` drops the remainder. TRL seeds the global RNG with ``args.seed`` (+ 100003 x process index) at
    the end of ``__init__``.
    """
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    order: list[list[int]] = []
    while len(order) < updates:
        torch.empty((), dtype=torch.int64).random_()  # the DataLoader iterator's base seed
        sampler_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(sampler_seed)).tolist()
        order += [perm[i : i + local_batch_size] for i in range(0, n - local_batch_size + 1, local_batch_size)]
    return order[:updates]


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_order_matches_trl112(case, trl_run):
    z, meta = trl_run
    info = meta["cases"][case]
    ctx, prompts = info["context_length"], _prompts()
    want = _trl_prompt_order(COMMON["seed"], N_PROMPTS, info["sizes"]["local_batch_size"], 2)
    for u in range(2):
        queries = z[f"{case}/u{u}/query_responses"][:, :ctx]
        assert [[int(t) for t in q if t != PAD] for q in queries] == [prompts[i] for i in want[u]]


if __name__ == "__main__":
    _trl112_driver(sys.argv[1])
