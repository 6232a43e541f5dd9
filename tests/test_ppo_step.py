"""The value-model path of the shared step (PPO): the jitted programs against a direct composition of the public
functions (rloo_jax.step.completion_logps / head_scores, rloo_jax.algorithms.ppo), and the value head against a
plain full forward (two paths that must agree)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rloo_jax as rj
from rloo_jax.algorithms import ppo
from rloo_jax.models import init_causal_lm, init_reward_model
from rloo_jax.programs import Programs
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import StepConfig, completion_logps, head_scores, last_scores, micro_batch_order
from tests import ppo_oracle as oracle
from tests.diffs import max_abs_diff

TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
)
RM = dict(TINY, architectures=["Qwen2ForSequenceClassification"])
EOS, PAD, C, T = 3, 0, 6, 0.9
LR = 0.5


@pytest.fixture(scope="module")
def parts():
    policy = nnx.split(init_causal_lm(TINY, seed=0))
    value = nnx.split(init_reward_model(RM, seed=1))
    reward = nnx.split(init_reward_model(RM, seed=2))
    return policy, value, reward


def _prompts():
    ids = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 0, 0, 21, 22, 23], [0, 30, 31, 32, 33, 34]],
                   np.int32)
    mask = (ids > 0).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


ALGO = rj.PPO(kl_coef=0.1, cliprange=0.1, cliprange_value=0.05, vf_coef=0.3, gamma=0.97, lam=0.9, num_ppo_epochs=2,
              num_mini_batches=2, gradient_accumulation_steps=2, pad_token_id=PAD, eos_token_id=EOS,
              stop_token_id=EOS, missing_eos_penalty=0.5)


def _cfg():
    # 4 rows; 2 epochs x 2 mini-batches of 2 rows; 2 micro-batches accumulate into each optimizer step (one per epoch)
    sampling = SamplingConfig(max_new_tokens=C, num_generations=1, temperature=T, eos_token_ids=(EOS,),
                              pad_token_id=PAD)
    return StepConfig(sampling=sampling, algorithm=ALGO, num_iterations=2, steps_per_generation=2,
                      gradient_accumulation_steps=2, recompute_old_logps=True,
                      logprob_temperature=T + ppo.TEMPERATURE_EPS, row_order=True, pad_is_padding=True)


@pytest.fixture(scope="module")
def run(parts):
    """A rollout and one update of the jitted programs (SGD), shared by the tests."""
    (graphdef, params), (vg, vp), (rg, rp) = parts
    programs = Programs(graphdef, optax.sgd(LR), _cfg(), value_graphdef=vg, reward_graphdef=rg)
    ref = jax.tree.map(lambda x: x + 0.02, _copy(params))  # reference != policy: the KL is not 0
    state = programs.init_state(_copy(params), _copy(ref), value_params=_copy(vp), reward_params=_copy(rp))
    ids, mask = _prompts()
    ro = programs.rollout(state, ids, mask, jax.random.key(3))
    host = jnp.asarray((np.asarray(ro.completion_ids) % 2 == 0).mean(1, keepdims=True).astype(np.float32))
    weights = jnp.asarray([1.0, 0.5])  # the device reward model, then the host function
    order = jnp.asarray(micro_batch_order(np.random.RandomState(0), 4, 2, 2))
    new_state, metrics = programs.update(state, ro, host, weights, order)
    return dict(programs=programs, state=state, ro=ro, host=host, weights=weights, order=order, new=new_state,
                metrics=jax.device_get(metrics), ref=ref)


def test_value_and_reward_heads_equal_a_full_forward(parts, run):
    """finish's per-token values and reward scores (the shared-prompt forward) == the head over one forward of
    [prompt; completion] (left-padded prompt, right-padded completion), read at TRL's positions: values before
    each token up to the first masked one (TRL's padding_mask_p1), the score at the last token before it."""
    (graphdef, params), (vg, vp), (rg, rp) = parts
    ro = run["ro"]
    full_ids = jnp.concatenate([ro.prompt_ids, ro.completion_ids], 1)
    full_mask = jnp.concatenate([ro.prompt_mask, ro.completion_mask], 1)
    p = ro.prompt_ids.shape[1]
    cm = np.asarray(ro.completion_mask) > 0
    first = np.where(cm.all(1), C, np.argmin(cm, axis=1))  # the first masked position (a sampled pad, EOS's next)
    used = np.arange(C)[None, :] <= first[:, None]
    value = nnx.merge(vg, vp)
    heads = np.asarray(value.head(value.model.forward(full_ids, full_mask)[0]))  # [N, P + C]
    np.testing.assert_allclose(np.asarray(ro.values)[used], heads[:, p - 1: -1][used], atol=1e-5)
    reward = nnx.merge(rg, rp)
    heads = np.asarray(reward.head(reward.model.forward(full_ids, full_mask)[0]))
    np.testing.assert_allclose(ro.scores[:, 0], heads[np.arange(len(first)), p - 1 + first], atol=1e-5)
    prefix = cm.sum(1) == first  # rows without a sampled pad: RewardModel's own pooling at the last real token
    np.testing.assert_allclose(ro.scores[prefix, 0], np.asarray(reward(full_ids, full_mask))[prefix], atol=1e-5)
    assert (first < C).any() and (first == C).any()


def test_last_scores_golden():
    heads = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    np.testing.assert_array_equal(last_scores(heads, jnp.array([[1, 0], [1, 1]])), [[2.0], [6.0]])
    np.testing.assert_array_equal(last_scores(heads, jnp.array([[0, 0], [0, 0]])), [[1.0], [4.0]])
    # a sampled pad (masked) ends the scored part, as TRL's first_true_indices(response == pad)
    np.testing.assert_array_equal(last_scores(heads, jnp.array([[0, 1], [1, 0]])), [[1.0], [5.0]])


def test_update_equals_sgd_on_the_ppo_loss_over_both_models(parts, run):
    """The jitted update (2 optimizer steps, each accumulating 2 shuffled micro-batches, policy and value model
    under one optimizer) == SGD on ppo_loss(completion_logps(policy), head_scores(value)) step by step."""
    (graphdef, params), (vg, vp), (rg, rp) = parts
    ro, order = run["ro"], np.asarray(run["order"])
    p_ids, p_mask, ids, mask = ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
    temp = T + ppo.TEMPERATURE_EPS
    # the rollout from the public functions: log-probs at the sampling parameters, reference, values, scores
    old = completion_logps(graphdef, params, p_ids, p_mask, ids, mask, temp) * mask
    ref = completion_logps(graphdef, run["ref"], p_ids, p_mask, ids, mask, temp) * mask
    values = head_scores(vg, vp, p_ids, p_mask, ids, mask)[:, :-1]
    rm = last_scores(head_scores(rg, rp, p_ids, p_mask, ids, mask), mask)
    scores = 1.0 * rm[:, 0] + 0.5 * run["host"][:, 0]
    width = ppo.generated_width(ids, EOS)
    post = jnp.where(mask > 0, ids, PAD)
    roll = ppo.ppo_rollout(ids, post, old, ref, values, scores, eos_token_id=EOS, pad_token_id=PAD, options=ALGO,
                           response_width=width)

    def loss(trained, rows):
        pol, val = trained
        sub = jax.tree.map(lambda x: None if x is None else x[rows], roll)
        new, entropy = completion_logps(graphdef, pol, p_ids[rows], p_mask[rows], ids[rows], mask[rows], temp,
                                        with_entropy=True)
        vpred = head_scores(vg, val, p_ids[rows], p_mask[rows], ids[rows], mask[rows])[:, :-1]
        return ppo.ppo_loss(new, vpred, sub, ALGO, entropy)

    trained, stats = (_copy(params), _copy(vp)), []
    for u in range(2):
        grads = []
        for j in range(2):
            (_, s), g = jax.value_and_grad(loss, has_aux=True)(trained, order[2 * u + j])
            grads.append(g)
            stats.append(s)
        mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
        trained = jax.tree.map(lambda p, g: p - LR * g, trained, mean)
    new = run["new"]
    for a, b in zip(jax.tree.leaves((new.params, new.value_params)), jax.tree.leaves(trained), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert int(new.step) == 2
    # the logged record: TRL's names, statistics over the zero-filled [E, M, A] = [2, 2, 2] tables (4 of 8 written)
    got = run["metrics"]["generation"]
    tables = {name: jnp.concatenate([jnp.stack([s[name] for s in stats]), jnp.zeros(4)])
              for name in ppo.STAT_NAMES}
    want = oracle.update_metrics(roll, tables, eos_token_id=EOS, lr=0.0, episode=0)
    for name, value in want.items():
        if name not in ("lr", "episode"):
            assert float(got[name]) == pytest.approx(float(value), rel=1e-4, abs=1e-6), name
    assert float(got["objective/kl"]) != 0 and float(got["val/ratio_var"]) > 0
    assert 0 < float(got["val/clipfrac_avg"]) and 0 < float(got["policy/clipfrac_avg"])  # both clippings fire


def test_state_trains_policy_and_value_with_one_optimizer(parts, run):
    """AdamW's moments mirror (policy, value); the reward model is carried through untouched."""
    (graphdef, params), (vg, vp), (rg, rp) = parts
    programs = Programs(graphdef, optax.adam(1e-3), _cfg(), value_graphdef=vg, reward_graphdef=rg)
    state = programs.init_state(_copy(params), _copy(params), value_params=_copy(vp), reward_params=_copy(rp))
    mu = state.opt_state[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure((state.params, state.value_params))
    new = run["new"]  # the shared run's update (SGD)
    for a, b in zip(jax.tree.leaves(new.reward_params), jax.tree.leaves(rp), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [max_abs_diff(a, b, "value parameter") for a, b in zip(jax.tree.leaves(new.value_params),
                                                                     jax.tree.leaves(vp), strict=True)]
    assert min(moved) > 0  # every value parameter, the score head included, is trained (NaN raises, tests/diffs.py)
    with pytest.raises(ValueError, match="value_params missing"):
        programs.init_state(_copy(params), _copy(params), reward_params=_copy(rp))
    with pytest.raises(ValueError, match="needs a value model"):
        Programs(graphdef, optax.adam(1e-3), _cfg())


def test_micro_batch_order_is_trl_minibatch_plan():
    """Consecutive micro-batches of each epoch's permutation: TRL's mini-batch / micro-batch loops, flattened."""
    rng_state = np.random.RandomState(7)
    order = micro_batch_order(rng_state, 8, 2, 2)
    perms = oracle.numpy_permutations(7, 8, 2, 1)[0]
    want = [rows for perm in perms for _, _, rows in oracle.minibatch_plan(perm, 4, 2)]
    np.testing.assert_array_equal(order, np.stack(want))
    assert order.dtype == np.int32 and order.shape == (8, 2)
