"""GRPO's pure functions: hand goldens, plain-Python oracles, and the algorithm value inside the jitted step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rloo_jax as rj
from rloo_jax.algorithms import grpo
from rloo_jax.models import init_causal_lm
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import StepConfig, completion_logps
from tests.diffs import tree_max_abs_diff

NAN = float("nan")


# ------------------------------------------------------------------------------------------------ advantages
def _oracle_advantages(rewards, weights, g, scale, aggregation):
    """TRL 1.16's scoring written as plain Python loops over groups (NaN = None)."""
    rows = len(rewards)

    def nanmean(xs):
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else NAN

    def nanstd(xs):
        xs = [x for x in xs if not math.isnan(x)]
        if len(xs) < 2:
            return NAN
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    def wsum(row):
        vals = [w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r)]
        return sum(vals) if vals else NAN

    if aggregation == "sum_then_normalize":
        r = [wsum(row) for row in rewards]
        adv = []
        for start in range(0, rows, g):
            grp = r[start:start + g]
            mean, std = nanmean(grp), nanstd(grp)
            if scale == "batch":
                std = nanstd(r)
            for x in grp:
                a = x - mean
                adv.append(a if scale == "none" else a / (std + 1e-4))
    else:
        norm = [list(row) for row in rewards]
        for f in range(len(weights)):
            for start in range(0, rows, g):
                col = [rewards[i][f] for i in range(start, start + g)]
                mean, std = nanmean(col), nanstd(col)
                for i in range(start, start + g):
                    norm[i][f] = (rewards[i][f] - mean) / (std + 1e-4)
        r = [wsum(row) if not all(math.isnan(x) for x in rewards[i]) else NAN for i, row in enumerate(norm)]
        mean, std = nanmean(r), nanstd(r)
        adv = [(x - mean) / (std + 1e-4) for x in r]
    return [0.0 if math.isnan(a) else a for a in adv]


def test_group_advantages_goldens():
    adv, std = rj.group_advantages(jnp.asarray([[1.0], [3.0], [0.0], [0.0]]), jnp.ones(1), 2)
    np.testing.assert_allclose(adv, [-1 / (2**0.5 + 1e-4), 1 / (2**0.5 + 1e-4), 0, 0], atol=1e-6)
    np.testing.assert_allclose(std, [2**0.5, 2**0.5, 0, 0], atol=1e-6)
    np.testing.assert_allclose(rj.grpo_advantages(jnp.asarray([1.0, 3.0, 0.0, 0.0]), 2, "none"), [-1, 1, 0, 0])
    # batch std: all four rewards (std of [1, 3, 0, 0] = 1.4142)
    adv, _ = rj.group_advantages(jnp.asarray([[1.0], [3.0], [0.0], [0.0]]), jnp.ones(1), 2, "batch")
    np.testing.assert_allclose(adv, np.array([-1, 1, 0, 0]) / (np.std([1, 3, 0, 0], ddof=1) + 1e-4), atol=1e-6)
    # an unscorable row: left out of its group's mean, advantage 0; a group with one scorable row: all 0
    adv, _ = rj.group_advantages(jnp.asarray([[1.0], [NAN], [2.0], [NAN], [5.0], [NAN]]), jnp.ones(1), 3, "none")
    np.testing.assert_allclose(adv, [-0.5, 0, 0.5, 0, 0, 0], atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_group_advantages_match_a_python_loop(scale, aggregation):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(12, 3))
    rewards[rng.random((12, 3)) < 0.25] = np.nan
    rewards[5] = np.nan  # a whole row unscorable
    weights = [1.0, 0.5, 2.0]
    want = _oracle_advantages(rewards.tolist(), weights, 4, scale, aggregation)
    got, _ = rj.group_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(weights), 4, scale, aggregation)
    np.testing.assert_allclose(got, want, atol=2e-5)  # float32 vs Python floats: measured 1.2e-6


# ------------------------------------------------------------------------------------------------ the loss pieces
def test_importance_ratio_and_gamma_weights():
    lr = jnp.asarray([[0.2, 0.4]])
    np.testing.assert_allclose(rj.importance_ratio(lr, jnp.ones((1, 2)), "token"), [[1.2214, 1.4918]], atol=1e-4)
    np.testing.assert_allclose(rj.importance_ratio(lr, jnp.ones((1, 2)), "sequence"), [[1.3499]], atol=1e-4)
    np.testing.assert_allclose(rj.importance_ratio(lr, jnp.asarray([[1, 0]]), "sequence"), [[1.2214]], atol=1e-4)
    mask = jnp.ones((2, 1))
    phi = rj.gamma_weights(jnp.asarray([[1.0], [-1.0]]), jnp.zeros((2, 1)), mask)
    np.testing.assert_allclose(phi, [[1.0], [1.0]], atol=1e-6)  # phi(1) = 1 for either sign
    phi = rj.gamma_weights(jnp.asarray([[1.0]]), jnp.asarray([[math.log(2)]]), jnp.ones((1, 1)))
    np.testing.assert_allclose(phi, [[math.exp(3 + 2 * math.log(2) - 6)]], rtol=1e-5)  # 0.1991


def test_per_token_loss_goldens():
    logp = jnp.asarray([[-1.0]])
    r15, pos, neg = jnp.asarray([[1.5]]), jnp.asarray([[1.0]]), jnp.asarray([[-1.0]])
    f = lambda r, a, kind, **kw: float(grpo.per_token_loss(logp, r, a, kind, 0.2, 0.2, **kw)[0][0, 0])  # noqa: E731
    assert f(r15, pos, "grpo") == pytest.approx(-1.2)  # clipped at 1 + eps
    assert f(r15, neg, "grpo") == pytest.approx(1.5)  # the pessimistic (unclipped) side
    assert f(r15, neg, "grpo", delta=1.4) == pytest.approx(1.4)  # two-sided: capped at delta
    assert f(r15, pos, "cispo") == pytest.approx(-0.2 * -1.0)  # -min(r, eps_high) * A * logp
    tau = 1.0
    assert f(r15, pos, "sapo") == pytest.approx(-(1 / (1 + math.exp(-0.5))) * 4 / tau)
    assert f(r15, neg, "sapo", sapo_temperature_neg=2.0) == pytest.approx(1 / (1 + math.exp(-1.0)) * 2)
    assert f(r15, pos, "vespo", phi=jnp.asarray([[0.5]])) == pytest.approx(0.5)  # -phi * A * logp
    with pytest.raises(ValueError, match="loss_type must be one of"):
        f(r15, pos, "ppo")


def test_aggregate_goldens():
    loss, mask = jnp.asarray([[1.0, 1.0], [2.0, 0.0]]), jnp.asarray([[1, 1], [1, 0]])
    got = {k: float(grpo.aggregate(loss, mask, k, 2)) for k in ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo",
                                                                 "vespo", "luspo")}
    assert got == pytest.approx({"grpo": 1.5, "sapo": 1.5, "bnpo": 4 / 3, "dr_grpo": 1.0, "dapo": 4 / 3,
                                 "cispo": 4 / 3, "vespo": 4 / 3, "luspo": 2.0})
    assert float(grpo.aggregate(loss, mask, "dapo", 2, jnp.asarray(8.0))) == pytest.approx(0.5)  # num_items
    assert float(grpo.aggregate(loss, mask, "dr_grpo", 6)) == pytest.approx(4 / 12)  # max_completion_length


def test_masks_and_kl_goldens():
    np.testing.assert_array_equal(rj.entropy_mask(jnp.asarray([[1.0, 2.0, 3.0, 4.0]]), jnp.ones((1, 4)), 0.5),
                                  [[0, 0, 1, 1]])  # threshold = quantile([1, 2, 3, 4], 0.5) = 2.5
    np.testing.assert_array_equal(rj.entropy_mask(jnp.asarray([[1.0, 9.0, 3.0]]), jnp.asarray([[1, 0, 1]]), 0.5),
                                  [[0, 0, 1]])  # the masked-out 9 neither counts nor is kept
    np.testing.assert_array_equal(rj.entropy_mask(jnp.ones((1, 2)), jnp.zeros((1, 2)), 0.2), [[0, 0]])  # none
    lp, sampled = jnp.zeros((2, 2)), jnp.full((2, 2), 0.6)
    keep = rj.off_policy_mask(jnp.asarray([[-1.0], [1.0]]), lp, sampled, jnp.ones((2, 2)), 0.5)
    np.testing.assert_array_equal(keep, [[0], [1]])
    np.testing.assert_allclose(rj.grpo_kl(jnp.asarray([[math.log(2)]]), jnp.zeros((1, 1))), [[0.1931]], atol=1e-4)
    np.testing.assert_allclose(rj.grpo_kl(jnp.asarray([[math.log(2)]]), jnp.zeros((1, 1)), jnp.asarray([[2.0]])),
                               [[0.3863]], atol=1e-4)


def test_adaptive_entropy_controller():
    """Skywork-OR1: after an optimizer step the coefficient moves by delta (up at or below the target, down above),
    within its bounds; the bonus of the next step applies only while the last step's entropy was at or below it."""
    f = grpo.adaptive_entropy_coef
    assert float(f(jnp.asarray(0.01), jnp.asarray(0.1), 0.2, 0.005, 0.0, 1.0)) == pytest.approx(0.015)
    assert float(f(jnp.asarray(0.01), jnp.asarray(0.3), 0.2, 0.005, 0.0, 1.0)) == pytest.approx(0.005)
    assert float(f(jnp.asarray(0.002), jnp.asarray(0.3), 0.2, 0.005, 0.0, 1.0)) == 0.0  # at its min
    algo = rj.GRPO(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=0.5, entropy_coef_delta=0.01)
    state = algo.init_state()
    assert float(state["last_entropy"]) == np.finfo(np.float32).max  # no bonus until a first measurement
    state, m = algo.next_state(state, {"entropy_sum": jnp.asarray(30.0), "entropy_count": jnp.asarray(10.0)})
    assert float(m["entropy_coef"]) == pytest.approx(0.04) and float(state["last_entropy"]) == pytest.approx(3.0)
    state, m = algo.next_state(state, {"entropy_sum": jnp.asarray(1.0), "entropy_count": jnp.asarray(10.0)})
    assert float(m["entropy_coef"]) == pytest.approx(0.05) and float(state["last_entropy"]) == pytest.approx(0.1)


def test_the_dapo_normaliser_is_the_generation_batch_tokens_per_step():
    """Two micro-batches of one optimizer step with num_items = T / spg: their mean loss is the token sum over
    the whole generation batch / (T / spg) / gas, TRL's num_items_in_batch normalisation."""
    algo = rj.GRPO(loss_type="dapo")
    rng = np.random.default_rng(1)
    logps = jnp.asarray(rng.normal(size=(4, 3)) * 0.1 - 1.0, jnp.float32)
    mask = jnp.asarray([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    total = float(jnp.sum(mask))  # T = 9 tokens, spg = gas = 2
    losses = [algo.loss(rj.LossInputs(logps[s], jnp.zeros_like(logps[s]), logps[s], mask[s], adv[s],
                                      num_items=jnp.asarray(total / 2)))[0] for s in (slice(0, 2), slice(2, 4))]
    per_token = -adv[:, None] * jnp.ones_like(logps)  # ratio 1: -A per token
    assert float(jnp.mean(jnp.stack(losses))) == pytest.approx(float(jnp.sum(per_token * mask) / total), rel=1e-6)


# ------------------------------------------------------------------------------------------------ in the step
TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
)
G, C = 4, 6


@pytest.fixture(scope="module")
def parts():
    graphdef, params = nnx.split(init_causal_lm(TINY, seed=0))
    ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6], jnp.int32)
    return graphdef, params, ids, mask


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_grpo_update_equals_sgd_on_the_composed_loss(parts, loss_type):
    """The jitted update of a GRPO step (KL in the loss, entropy bonus with its gradient) == SGD on the algorithm's
    loss over the same forward: the step composes the pure functions and adds nothing."""
    graphdef, params, ids, mask = parts
    algo = rj.GRPO(beta=0.1, loss_type=loss_type, entropy_coef=0.05, max_completion_length=C)
    sampling = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9, eos_token_ids=(3,), pad_token_id=0)
    step = Programs(graphdef, optax.sgd(0.5), StepConfig(sampling=sampling, algorithm=algo))
    ref = jax.tree.map(lambda x: x + 0.01, _copy(params))  # policy != reference: the KL term has a gradient
    state = step.init_state(_copy(params), _copy(ref))  # (update donates the state)
    ro = step.rollout(state, ids, mask, jax.random.key(0))
    rewards = jnp.asarray((np.asarray(ro.completion_ids) % 3 == 0).mean(1, keepdims=True), jnp.float32)
    targets, _ = step.score(ro, rewards, jnp.ones(1))
    p_ids, p_mask = jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0)

    def direct(p):
        lp, ent = completion_logps(graphdef, p, p_ids, p_mask, ro.completion_ids, ro.completion_mask, 0.9,
                                   with_entropy=True, entropy_grad=True)
        m = ro.completion_mask.astype(jnp.float32)
        loss, metrics, _ = algo.loss(rj.LossInputs(
            lp, ent, jax.lax.stop_gradient(lp), m, targets["advantages"], ref_logps=ro.ref_logps,
            num_items=jnp.maximum(jnp.sum(m), 1.0), algo_state=algo.init_state()))
        return loss, metrics

    (loss, want), grads = jax.value_and_grad(direct, has_aux=True)(params)
    new_state, metrics = step.update(state, ro, rewards, jnp.ones(1))
    metrics = flat_metrics(metrics)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(jax.tree.map(lambda p, g: p - 0.5 * g,
                                                                                      params, grads)), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert float(metrics["loss"]) == pytest.approx(float(loss), abs=1e-6)
    assert abs(float(metrics["kl"])) > 1e-6 and float(metrics["kl"]) == pytest.approx(float(want["kl"]), rel=1e-5)
    assert float(metrics["entropy_coef"]) == pytest.approx(0.05)
    # the entropy bonus has a gradient: without it the update differs
    no_bonus = rj.GRPO(beta=0.1, loss_type=loss_type, max_completion_length=C)
    other = Programs(graphdef, optax.sgd(0.5), StepConfig(sampling=sampling, algorithm=no_bonus))
    plain, _ = other.update(other.init_state(_copy(params), _copy(ref)), ro, rewards, jnp.ones(1))
    assert tree_max_abs_diff(plain.params, new_state.params, "update without vs with the bonus") > 1e-6


def test_adaptive_entropy_state_moves_across_updates_and_is_in_the_train_state(parts):
    """num_iterations 2: two optimizer steps in one update program; the controller moves after each (entropy of a
    random tiny model, ~3.5 nats, above the target: down by delta twice), carried in TrainState.algo_state."""
    graphdef, params, ids, mask = parts
    algo = rj.GRPO(entropy_coef=0.05, use_adaptive_entropy=True, entropy_coef_delta=0.01, max_completion_length=C)
    sampling = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9, eos_token_ids=(3,), pad_token_id=0)
    step = Programs(graphdef, optax.sgd(0.1), StepConfig(sampling=sampling, algorithm=algo, num_iterations=2))
    state = step.init_state(_copy(params))
    ro = step.rollout(state, ids, mask, jax.random.key(1))
    rewards = jnp.asarray(np.arange(2 * G, dtype=np.float32)[:, None])
    state, metrics = step.update(state, ro, rewards, jnp.ones(1))
    np.testing.assert_allclose(metrics["update"]["entropy_coef"], [0.04, 0.03], atol=1e-7)
    assert float(state.algo_state["entropy_coef"]) == pytest.approx(0.03)
    assert 2.0 < float(state.algo_state["last_entropy"]) < math.log(40)
