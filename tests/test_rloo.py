"""RLOO math: hand goldens, plain-loop oracles, NaN rows, G=1, clip boundaries, REINFORCE gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rloo_jax as rj

nan = float("nan")


# ------------------------------------------------------------------------------------------------- oracles


def loop_rloo(rewards, g):
    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        valid = [r for r in grp if not math.isnan(r)]
        for r in grp:
            if g == 1:
                out.append(0.0)
            elif math.isnan(r) or len(valid) <= 1:
                out.append(nan)
            else:
                out.append(r - (sum(valid) - r) / (len(valid) - 1))
    return np.array(out, np.float64)


def loop_std(xs):
    xs = [x for x in xs if not math.isnan(x)]
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def loop_objective(logps, old, adv, mask, eps_lo, eps_hi):
    losses, low, high = [], [], []
    for i in range(len(adv)):
        lr = sum((logps[i][t] - old[i][t]) * mask[i][t] for t in range(len(mask[i])))
        ratio = math.exp(lr)
        clipped = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
        losses.append(-min(ratio * adv[i], clipped * adv[i]))
        low.append(float(ratio < 1 - eps_lo and adv[i] < 0))
        high.append(float(ratio > 1 + eps_hi and adv[i] > 0))
    return sum(losses) / len(losses), low, high


# ------------------------------------------------------------------------------------------------- advantages


def test_rloo_advantages_hand_golden():
    out = rj.rloo_advantages(jnp.array([1.0, 0.0, 2.5, -1.0]), 4)
    np.testing.assert_allclose(out, [0.5, -5 / 6, 2.5, -13 / 6], rtol=1e-6)
    out = rj.rloo_advantages(jnp.arange(1.0, 7.0), 3)
    np.testing.assert_allclose(out, [-1.5, 0.0, 1.5, -1.5, 0.0, 1.5], rtol=1e-6)


def test_rloo_advantages_loop_oracle_with_nans():
    rng = np.random.default_rng(0)
    for g in (2, 3, 4, 8):
        r = rng.normal(size=4 * g)
        r[rng.random(r.shape) < 0.25] = nan
        got = np.asarray(jax.jit(rj.rloo_advantages, static_argnums=1)(jnp.asarray(r, jnp.float32), g))
        want = loop_rloo(r.tolist(), g)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_rloo_advantages_nan_rows_excluded_from_baseline():
    # group [1, nan, 3]: row 0 baseline = 3 (only other scorable), row 2 baseline = 1
    out = rj.rloo_advantages(jnp.array([1.0, nan, 3.0]), 3)
    np.testing.assert_allclose(out, [-2.0, nan, 2.0], equal_nan=True)
    # single scorable row in a group -> 0/0 = nan
    out = rj.rloo_advantages(jnp.array([nan, 2.0]), 2)
    assert np.isnan(np.asarray(out)).all()


def test_rloo_advantages_g1_is_zero_and_bad_batch_raises():
    np.testing.assert_array_equal(rj.rloo_advantages(jnp.array([1.0, 5.0]), 1), [0.0, 0.0])
    with pytest.raises(ValueError, match="multiple of num_generations"):
        rj.rloo_advantages(jnp.ones(5), 2)


def test_rloo_advantages_sum_to_zero_per_group():
    r = jnp.asarray(np.random.default_rng(1).normal(size=12), jnp.float32)
    a = rj.rloo_advantages(r, 4).reshape(3, 4)
    np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-5)


def test_normalize_advantages_golden_and_oracle():
    out = rj.normalize_advantages(jnp.array([1.0, 3.0]))
    s = math.sqrt(2.0)  # ddof=1 std of [1, 3]
    np.testing.assert_allclose(out, [-1 / (s + 1e-4), 1 / (s + 1e-4)], rtol=1e-6)
    a = [0.3, nan, -1.2, 2.0, 0.5]
    valid = [x for x in a if not math.isnan(x)]
    m, s = sum(valid) / len(valid), loop_std(a)
    want = [(x - m) / (s + 1e-4) for x in a]
    np.testing.assert_allclose(rj.normalize_advantages(jnp.array(a)), want, rtol=1e-5, equal_nan=True)


def test_grpo_advantages_scales():
    r = jnp.array([1.0, 3.0, 0.0, 0.0])
    np.testing.assert_allclose(rj.grpo_advantages(r, 2, "none"), [-1, 1, 0, 0])
    s = math.sqrt(2.0)
    np.testing.assert_allclose(rj.grpo_advantages(r, 2, "group"), [-1 / (s + 1e-4), 1 / (s + 1e-4), 0, 0], rtol=1e-6)
    sb = loop_std([1.0, 3.0, 0.0, 0.0])
    np.testing.assert_allclose(rj.grpo_advantages(r, 2, "batch"), [-1 / (sb + 1e-4), 1 / (sb + 1e-4), 0, 0], rtol=1e-6)
    with pytest.raises(ValueError):
        rj.grpo_advantages(r, 2, "bogus")


# ------------------------------------------------------------------------------------------------- rewards, KL


def test_combine_rewards_nan_aware():
    r = jnp.array([[1.0, nan], [nan, nan], [0.5, 2.0]])
    np.testing.assert_allclose(rj.combine_rewards(r, jnp.array([2.0, 1.0])), [2.0, nan, 3.0], equal_nan=True)
    np.testing.assert_allclose(rj.combine_rewards(r), [1.0, nan, 2.5], equal_nan=True)
    with pytest.raises(AssertionError):
        rj.combine_rewards(r, jnp.array([1.0, 2.0, 3.0]))


def test_token_and_sequence_kl():
    d = jnp.array([[math.log(2.0)]])
    z = jnp.zeros((1, 1))
    np.testing.assert_allclose(rj.token_kl(d, z, "k1"), [[0.693147]], rtol=1e-5)
    np.testing.assert_allclose(rj.token_kl(d, z, "k2"), [[0.5 * math.log(2) ** 2]], rtol=1e-5)
    np.testing.assert_allclose(rj.token_kl(d, z, "k3"), [[0.5 - 1 + math.log(2)]], rtol=1e-5)
    with pytest.raises(ValueError):
        rj.token_kl(d, z, "k4")
    out = rj.sequence_kl(jnp.array([[-1.0, -2.0, -3.0]]), jnp.array([[-1.5, -1.0, 9.0]]), jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose(out, [-0.5])


# ------------------------------------------------------------------------------------------------- objective


def _rand_batch(seed, b=6, c=5):
    rng = np.random.default_rng(seed)
    logps = rng.normal(size=(b, c)).astype(np.float32) * 0.3 - 1
    old = logps + rng.normal(size=(b, c)).astype(np.float32) * 0.2
    adv = rng.normal(size=b).astype(np.float32)
    mask = (rng.random((b, c)) < 0.8).astype(np.int32)
    return logps, old, adv, mask


@pytest.mark.parametrize("eps_hi", [None, 0.28])
def test_clipped_objective_loop_oracle(eps_hi):
    logps, old, adv, mask = _rand_batch(2)
    loss, m = jax.jit(rj.clipped_objective, static_argnames=("epsilon", "epsilon_high"))(
        logps, old, adv, mask, epsilon=0.2, epsilon_high=eps_hi
    )
    want, low, high = loop_objective(logps.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, eps_hi or 0.2)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(m["clip_ratio/low_mean"], np.mean(low), rtol=1e-6)
    np.testing.assert_allclose(m["clip_ratio/high_mean"], np.mean(high), rtol=1e-6)
    np.testing.assert_allclose(m["clip_ratio/region_mean"], np.mean(np.maximum(low, high)), rtol=1e-6)
    assert float(m["clip_ratio/low_min"]) == min(low) and float(m["clip_ratio/high_max"]) == max(high)


def test_clip_boundaries_both_sides():
    """ratio just inside/outside [1 - eps, 1 + eps_high], with positive and negative advantages."""
    eps, eps_hi = 0.2, 0.3
    mask = jnp.ones((1, 1))

    def run(ratio, a):
        loss, m = rj.clipped_objective(jnp.array([[math.log(ratio)]]), jnp.zeros((1, 1)), jnp.array([a]), mask,
                                       epsilon=eps, epsilon_high=eps_hi)
        g = jax.grad(lambda lp: rj.clipped_objective(lp, jnp.zeros((1, 1)), jnp.array([a]), mask,
                                                     epsilon=eps, epsilon_high=eps_hi)[0])(
            jnp.array([[math.log(ratio)]]))
        return float(loss), m, float(g[0, 0])

    # A > 0, ratio above 1 + eps_high: clipped, loss = -(1.3) * A, no gradient, high clip
    loss, m, g = run(1.5, 2.0)
    assert loss == pytest.approx(-1.3 * 2.0) and g == 0.0 and float(m["clip_ratio/high_mean"]) == 1.0
    # A > 0, ratio inside: loss = -ratio * A, gradient = -ratio * A (d ratio / d logp = ratio)
    loss, m, g = run(1.25, 2.0)
    assert loss == pytest.approx(-2.5) and g == pytest.approx(-2.5) and float(m["clip_ratio/region_mean"]) == 0
    # A > 0, ratio below 1 - eps: min picks the unclipped (smaller) term: gradient flows, not counted as clipped
    loss, m, g = run(0.5, 2.0)
    assert loss == pytest.approx(-1.0) and g == pytest.approx(-1.0) and float(m["clip_ratio/low_mean"]) == 0
    # A < 0, ratio below 1 - eps: clipped at 0.8, no gradient, low clip
    loss, m, g = run(0.5, -1.0)
    assert loss == pytest.approx(0.8) and g == 0.0 and float(m["clip_ratio/low_mean"]) == 1.0
    # A < 0, ratio above 1 + eps_high: unclipped term is larger -> gradient flows
    loss, m, g = run(1.5, -1.0)
    assert loss == pytest.approx(1.5) and g == pytest.approx(1.5) and float(m["clip_ratio/region_mean"]) == 0


def test_token_level_aggregations_oracle():
    logps, old, adv, mask = _rand_batch(3, b=4, c=6)
    b, c = mask.shape
    per_tok = np.zeros((b, c))
    for i in range(b):
        for t in range(c):
            r = math.exp(logps[i, t] - old[i, t])
            per_tok[i, t] = -min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i])
    grpo = np.mean([(per_tok[i] * mask[i]).sum() / max(mask[i].sum(), 1) for i in range(b)])
    bnpo = (per_tok * mask).sum() / mask.sum()
    dr = (per_tok * mask).sum() / (b * c)
    for agg, want in [("grpo", grpo), ("bnpo", bnpo), ("dr_grpo", dr), ("dapo", bnpo)]:
        loss, _ = rj.clipped_objective(logps, old, adv, mask, level="token", aggregation=agg)
        np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=agg)
    loss, _ = rj.clipped_objective(logps, old, adv, mask, level="token", aggregation="dapo", num_items=100.0)
    np.testing.assert_allclose(loss, (per_tok * mask).sum() / 100.0, rtol=1e-5)


def test_gradient_at_ratio_one_is_reinforce():
    """On-policy: d loss / d logp[i, t] = -A_i * mask[i, t] / B (the REINFORCE estimator)."""
    logps, _, adv, mask = _rand_batch(4)
    grad = jax.grad(lambda lp: rj.clipped_objective(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv), mask)[0])(
        jnp.asarray(logps)
    )
    np.testing.assert_allclose(grad, -adv[:, None] * mask / len(adv), rtol=1e-6)


def test_rloo_loss_end_to_end_golden():
    """A 2-prompt x G=2 batch worked on paper, with beta, a None reward and reward clipping."""
    logps = jnp.array([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0], [-2.0, -1.0]])
    ref = jnp.array([[-1.5, -2.0], [-0.5, -1.5], [-1.0, -1.0], [-2.0, -1.0]])
    mask = jnp.array([[1, 1], [1, 0], [1, 1], [1, 1]])
    trunc = jnp.array([False, False, False, True])
    rpf = jnp.array([[1.0, nan], [3.0, nan], [nan, nan], [0.5, 10.0]])
    opts = rj.RLOOOptions(beta=0.1, reward_clip_range=(-5.0, 5.0))
    loss, m = rj.rloo_loss(logps, None, ref, rpf, mask, trunc, num_generations=2, options=opts)
    # rewards: [1, 3, nan, 10.5 -> clip 5]; seq kl (old = logps): [0.5, 0, 0, 0]; r - 0.1 kl = [0.95, 3, nan, 5]
    # LOO: group0 -> [0.95 - 3, 3 - 0.95] = [-2.05, 2.05]; group1 -> [nan, 0/0] -> [0, 0]
    # ratio 1 -> loss = -mean(A) = 0
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert float(m["advantage_abs_mean"]) == pytest.approx(2.05 / 2, rel=1e-5)
    assert float(m["reward"]) == pytest.approx((1 + 3 + 10.5) / 3, rel=1e-6)
    assert float(m["kl"]) == pytest.approx(0.5 / 7, rel=1e-5)
    g = jax.grad(lambda lp: rj.rloo_loss(lp, None, ref, rpf, mask, trunc, num_generations=2, options=opts)[0])(logps)
    want = -np.array([-2.05, 2.05, 0.0, 0.0])[:, None] * np.asarray(mask) / 4
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_rloo_loss_mask_truncated_and_missing_eos_penalty():
    logps = jnp.full((4, 3), -1.0)
    mask = jnp.ones((4, 3), jnp.int32)
    trunc = jnp.array([False, True, False, False])
    rpf = jnp.array([[1.0], [2.0], [0.0], [0.0]])
    opts = rj.RLOOOptions(beta=0.0, mask_truncated_completions=True, missing_eos_penalty=1.5)
    g = jax.grad(lambda lp: rj.rloo_loss(lp, None, None, rpf, mask, trunc, num_generations=2, options=opts)[0])(logps)
    # rewards [1, 0.5, 0, 0]: A = [0.5, -0.5, 0, 0]; truncated row 1 gets no gradient, still in the mean (B = 4)
    np.testing.assert_allclose(g[0], [-0.5 / 4] * 3, rtol=1e-6)
    np.testing.assert_array_equal(g[1], [0.0, 0.0, 0.0])


def test_token_level_kl_moves_penalty_into_the_loss():
    logps = jnp.array([[-1.0, -1.0], [-2.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0], [-1.0, -1.0]])
    mask = jnp.ones((2, 2))
    rpf = jnp.array([[1.0], [1.0]])
    opts = rj.RLOOOptions(beta=0.5, token_level_kl=True, kl_estimator="k3")
    loss, m = rj.rloo_loss(logps, None, ref, rpf, mask, jnp.zeros(2, bool), num_generations=2, options=opts)
    k3 = lambda d: math.exp(-d) - 1 + d  # noqa: E731
    want_kl = np.mean([(k3(0.5) + 0) / 2, (k3(-1.0) + 0) / 2])
    assert float(loss) == pytest.approx(0.5 * want_kl, rel=1e-5)  # equal rewards -> A = 0, only the KL term


def test_functions_work_under_vmap():
    r = jnp.asarray(np.random.default_rng(5).normal(size=(3, 8)), jnp.float32)
    out = jax.vmap(lambda x: rj.rloo_advantages(x, 4))(r)
    for i in range(3):
        np.testing.assert_allclose(out[i], rj.rloo_advantages(r[i], 4), rtol=1e-6)


# ------------------------------------------------------------------------------------------------- sampler vs trainer


def loop_is_weights(train, sampler, mask, mode, lo, hi):
    """TRL GRPO's importance-sampling ratios as a plain loop: per sequence (sum of gaps) or per token."""
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi

    def bound(r):
        if mode.endswith("truncate"):
            return min(max(r, lo), hi)
        return r if lo <= r <= hi else 0.0

    out = []
    for i in range(len(mask)):
        d = [(train[i][t] - sampler[i][t]) * mask[i][t] for t in range(len(mask[i]))]
        out.append(bound(math.exp(sum(d))) if mode.startswith("sequence") else [bound(math.exp(x)) for x in d])
    return np.array(out, np.float64)


def test_sampling_logp_difference_golden_and_oracle():
    m = rj.sampling_logp_difference(jnp.array([[-1.0, -2.0, -9.0]]), jnp.array([[-1.5, -2.0, -1.0]]),
                                    jnp.array([[1, 1, 0]]))
    assert float(m["sampling/sampling_logp_difference/mean"]) == 0.25
    assert float(m["sampling/sampling_logp_difference/max"]) == 0.5  # the masked-out 8.0 is not counted
    train, sampler, _, mask = _rand_batch(7)
    m = jax.jit(rj.sampling_logp_difference)(train, sampler, mask)
    gaps = [abs(float(train[i, t]) - float(sampler[i, t])) for i in range(6) for t in range(5) if mask[i, t]]
    np.testing.assert_allclose(m["sampling/sampling_logp_difference/mean"], sum(gaps) / len(gaps), rtol=1e-6)
    np.testing.assert_allclose(m["sampling/sampling_logp_difference/max"], max(gaps), rtol=1e-6)
    empty = rj.sampling_logp_difference(train, sampler, np.zeros_like(mask))
    assert float(empty["sampling/sampling_logp_difference/mean"]) == 0.0 == float(
        empty["sampling/sampling_logp_difference/max"])


def test_importance_sampling_weights_goldens():
    train, sampler, mask = jnp.array([[0.1, 0.2]]), jnp.zeros((1, 2)), jnp.ones((1, 2))

    def w(mode, lo=None, hi=1.2):
        return np.asarray(rj.importance_sampling_weights(train, sampler, mask, mode, lo, hi)[0])

    np.testing.assert_allclose(w("sequence_truncate"), [1.2])  # exp(0.3) = 1.35 clipped
    np.testing.assert_allclose(w("sequence_mask"), [0.0])  # outside [-inf, 1.2]: masked
    np.testing.assert_allclose(w("sequence_mask", hi=1.4), [math.exp(0.3)], rtol=1e-6)
    np.testing.assert_allclose(w("token_truncate"), [[math.exp(0.1), 1.2]], rtol=1e-6)
    np.testing.assert_allclose(w("token_mask", lo=1.11, hi=None), [[0.0, math.exp(0.2)]], rtol=1e-6)
    with pytest.raises(ValueError, match="importance sampling mode"):
        rj.importance_sampling_weights(train, sampler, mask, "sequence")


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.9, 1.1), (0.95, None)])
def test_importance_sampling_weights_loop_oracle(mode, bounds):
    train, sampler, _, mask = _rand_batch(8, b=8, c=5)
    sampler = train + (sampler - train) * 0.3  # gaps ~0.06 per token: some ratios inside, some outside the bounds
    lo, hi = bounds
    weights, m = rj.importance_sampling_weights(train, sampler, mask, mode, lo, hi)
    want = loop_is_weights(train.tolist(), sampler.tolist(), mask.tolist(), mode, lo, hi)
    np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-7)
    counted = want if mode.startswith("sequence") else want[mask > 0]
    np.testing.assert_allclose(m["sampling/importance_sampling_ratio/min"], counted.min(), rtol=1e-5)
    np.testing.assert_allclose(m["sampling/importance_sampling_ratio/mean"], counted.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["sampling/importance_sampling_ratio/max"], counted.max(), rtol=1e-5)
    if bounds == (0.9, 1.1) and mode.endswith("mask"):
        assert 0 < (counted == 0).sum() < counted.size, "some ratios masked, some kept: the oracle is exercised"


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_clipped_objective_with_importance_weights_loop_oracle(level):
    """TRL GRPO: each sequence's (token's) clipped loss times its importance weight, then aggregated."""
    logps, old, adv, mask = _rand_batch(9)
    weights = np.random.default_rng(9).uniform(0.0, 2.0, size=(6,) if level == "sequence" else (6, 5))
    weights = weights.astype(np.float32)
    loss, _ = rj.clipped_objective(logps, old, adv, mask, level=level, importance_weights=weights)
    b, c = mask.shape
    if level == "sequence":
        each = []
        for i in range(b):
            ratio = math.exp(sum((logps[i, t] - old[i, t]) * mask[i, t] for t in range(c)))
            each.append(-min(ratio * adv[i], min(max(ratio, 0.8), 1.2) * adv[i]) * weights[i])
        want = sum(each) / b
    else:
        rows = []
        for i in range(b):
            tok = [-min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i]) * weights[i, t] * mask[i, t]
                   for t, r in enumerate(math.exp(logps[i, t] - old[i, t]) for t in range(c))]
            rows.append(sum(tok) / max(mask[i].sum(), 1))
        want = sum(rows) / b
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # the weights carry no gradient: d loss / d weights is not defined through them, only the ratio's
    g = jax.grad(lambda w: rj.clipped_objective(logps, old, adv, mask, level=level, importance_weights=w)[0])(
        jnp.asarray(weights))
    assert float(jnp.abs(g).max()) == 0.0
