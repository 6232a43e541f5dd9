"""PPO as TRL 1.12's ``PPOTrainer`` computes it, as pure functions.

Everything between "the completions are generated" and "the optimizer steps" in
``trl/experimental/ppo/ppo_trainer.py`` (TRL 1.12.0, the last release with PPO), in TRL's order:

1. ``truncate_response``: cut each response after the first ``stop_token_id`` (TRL's ``postprocessed_response``).
2. The reward model scores ``query + postprocessed_response`` at the token before its first pad; the value model
   runs on the *un*-truncated ``query + response`` and is read at ``response_slice``.
3. ``ppo_rollout``: sequence lengths, ``padding_mask`` / ``padding_mask_p1``, ``INVALID_LOGPROB`` fills,
   ``missing_eos_penalty``, per-token KL (k1/k3), the score added at ``score_positions``, optional reward whitening,
   GAE (``gae``, a reverse ``lax.scan``), returns, advantage whitening.
4. Per micro-batch: ``ppo_loss`` (clipped policy loss + ``vf_coef`` * clipped value loss, TRL's masked means) and
   its statistics, on the rows TRL's ``np.random.permutation`` shuffles put in it (``rloo_jax.step.micro_batch_order``).
5. Per update: the statistics in TRL's zero-filled tables (``zero_filled_tables``, ``table_metrics``) give the logged
   dict with TRL's names and averaging (``PPO.summarize``).

TRL's loop itself (its batch sizes, shuffles, mini-batch and accumulation order, statistics tables and logged dict)
is re-written as plain functions in tests/ppo_oracle.py, which the tests hold these against.

Shapes: B rows (``local_batch_size``), P query length (``context_length``), L response length
(``response_length``), V vocabulary, E ``num_ppo_epochs``, M ``num_mini_batches``, A ``gradient_accumulation_steps``.

TRL's response width is data-dependent: generation stops once every row of a chunk has produced the stop token, so
TRL's tensors are ``W = generated_width(...) <= L`` wide. W changes where a full-width response's score lands and the
denominators of the all-position statistics. Fixed-shape callers keep L columns and pass ``response_width=W``:
everything at ``t >= W`` is then masked as TRL's missing columns (tests/test_ppo_math.py checks this against a TRL
run whose generation stopped early).
docs/ppo.md describes TRL's code path, line by line, and its quirks.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rloo_jax.algorithms.common import LossInputs, ScoreInputs, combine_rewards
from rloo_jax.errors import ConfigError
from rloo_jax.logprobs import entropy_from_logits, per_token_logps

Array = jax.Array
KLEstimator = Literal["k1", "k3"]

INVALID_LOGPROB = 1.0
"""TRL fills log-probs at padding positions with 1.0 (so old/new differences there are 0 and ratios 1)."""
TEMPERATURE_EPS = 1e-7
"""TRL divides logits by ``temperature + 1e-7`` (rollout, reference and training forward alike)."""
WHITEN_EPS = 1e-8
"""``masked_whiten``: ``(x - mean) * rsqrt(var + 1e-8)``."""

STAT_NAMES = ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")
"""The per-micro-batch statistics ``ppo_loss`` returns; TRL's ``*_stats`` tables, in its names."""


@dataclasses.dataclass(frozen=True)
class PPOOptions:
    """The PPO math knobs, with TRL 1.12 ``PPOConfig`` names and defaults. Frozen and hashable (static for jit)."""

    kl_coef: float = 0.05
    kl_estimator: KLEstimator = "k1"
    missing_eos_penalty: float | None = None
    """Subtracted from the score of rows whose *postprocessed* response has no ``eos_token_id``."""
    whiten_rewards: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1

    def __post_init__(self) -> None:
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3' (TRL 1.12 PPO), got {self.kl_estimator!r}")


@struct.dataclass
class PPORollout:
    """One generation batch after TRL's rollout processing; every field has B rows (index it with a micro-batch)."""

    responses: Array  # [B, L] int32, as generated (not truncated): the training forward's targets
    postprocessed_responses: Array  # [B, L] int32, cut after the first stop token (pad after it)
    sequence_lengths: Array  # [B] int32, index of the last non-pad token of the postprocessed response (-1: none)
    contain_eos_token: Array  # [B] bool, the postprocessed response holds eos_token_id
    padding_mask: Array  # [B, L] bool, True at t > sequence_length (log-prob / policy-loss padding)
    padding_mask_p1: Array  # [B, L] bool, True at t > sequence_length + 1 (value padding)
    logprobs: Array  # [B, L] float32, rollout log-probs, INVALID_LOGPROB at padding
    ref_logprobs: Array  # [B, L] float32, reference log-probs, INVALID_LOGPROB at padding
    values: Array  # [B, L] float32, value head at the response positions, 0 at padding_mask_p1
    scores: Array  # [B] float32, reward-model scores after missing_eos_penalty
    kl: Array  # [B, L] float32, per-token KL estimate (0 at padding)
    non_score_reward: Array  # [B, L] float32, -kl_coef * kl
    rewards: Array  # [B, L] float32, non_score_reward + score at score_positions (whitened if whiten_rewards)
    advantages: Array  # [B, L] float32, GAE, whitened over ~padding_mask, 0 at padding
    returns: Array  # [B, L] float32, GAE advantages (before whitening) + values
    response_width: Array  # [B] int32, TRL's tensor width W (the same in every row; L unless generation stopped early)


# ----------------------------------------------------------------------------------------------- tokens and masks


def first_true_indices(bools: Array) -> Array:
    """Index of the first True along the last axis; the row length where there is none (TRL's helper).

    ``min(row_len * ~b + arange(row_len))``. ``[[F, T, T], [F, F, F]] -> [1, 3]``.
    """
    row_len = bools.shape[-1]
    zero_or_index = row_len * (~bools).astype(jnp.int32) + jnp.arange(row_len, dtype=jnp.int32)
    return jnp.min(zero_or_index, axis=-1)


def truncate_response(responses: Array, stop_token_id: int | None, pad_token_id: int) -> Array:
    """TRL's ``postprocessed_response``: every token after the first ``stop_token_id`` becomes ``pad_token_id``.

    The stop token itself is kept. ``stop_token_id=None`` returns the responses unchanged (TRL skips the call; an id
    of 0 is honoured). ``[[5, 2, 7, 2]]`` with stop 2, pad 0 -> ``[[5, 2, 0, 0]]``.

    Args:
      responses: ``[B, L]`` int.
    """
    if stop_token_id is None:
        return responses
    trunc = first_true_indices(responses == stop_token_id)[:, None]
    idx = jnp.arange(responses.shape[1])[None, :]
    return jnp.where(idx > trunc, jnp.asarray(pad_token_id, responses.dtype), responses)


def response_slice(per_position: Array, context_length: int) -> Array:
    """Outputs at the positions that predict the response tokens: ``x[:, P - 1 : -1]``.

    Used for policy logits (``[B, P + L, V] -> [B, L, V]``) and value-head outputs (``[B, P + L, 1] -> [B, L]``,
    the trailing 1 squeezed): ``values[:, t]`` is the value of the state before response token t.
    """
    out = per_position[:, context_length - 1 : -1]
    return out[..., 0] if out.ndim == 3 and out.shape[-1] == 1 else out


def sequence_lengths(postprocessed_responses: Array, pad_token_id: int) -> Array:
    """``first_true_indices(response == pad) - 1``: the last kept position (``[B]`` int32; -1 for an empty response,
    L - 1 with no pad). ``[[5, 1, 0, 0], [5, 6, 7, 8]]`` -> ``[1, 3]``."""
    return first_true_indices(postprocessed_responses == pad_token_id) - 1


def padding_masks(
    seq_lengths: Array, response_length: int, response_width: Array | int | None = None
) -> tuple[Array, Array]:
    """``(padding_mask, padding_mask_p1)``: ``t > len`` and ``t > len + 1`` (``[B, L]`` bool), both also True at
    ``t >= response_width`` (columns TRL's narrower tensors do not have) when that is given.

    ``padding_mask`` masks log-probs, KL and the policy loss; ``padding_mask_p1`` keeps one more position (where the
    score lands) for values, returns and the value loss. ``len 1, L 4`` -> ``[F, F, T, T]`` and ``[F, F, F, T]``;
    ``len 2, L 4, width 3`` -> ``[F, F, F, T]`` and ``[F, F, F, T]``.
    """
    idx = jnp.arange(response_length)[None, :]
    pm, pm1 = idx > seq_lengths[:, None], idx > seq_lengths[:, None] + 1
    if response_width is not None:
        beyond = idx >= jnp.reshape(jnp.asarray(response_width), (-1, 1))
        pm, pm1 = pm | beyond, pm1 | beyond
    return pm, pm1


def generated_width(responses: Array, stop_token_id: int | None) -> Array:
    """TRL's response width W: ``max_b min(first stop index + 1, L)``; L when ``stop_token_id`` is None.

    TRL sets the policy's ``generation_config.eos_token_id = stop_token_id``, so ``generate`` stops a chunk once all its
    rows produced it, and ``batch_generation`` right-pads the chunks to the widest: W is the longest response up to
    and including its first stop token. From fixed-width tokens (anything after a row's stop token is ignored):
    ``[[5, 2, 0, 0], [2, 0, 0, 0]]`` with stop 2 -> ``2``. Returns a scalar int32.
    """
    length = responses.shape[1]
    if stop_token_id is None:
        return jnp.asarray(length, jnp.int32)
    return jnp.max(jnp.minimum(first_true_indices(responses == stop_token_id) + 1, length)).astype(jnp.int32)


def policy_logprobs(logits: Array, responses: Array, temperature: float) -> tuple[Array, Array]:
    """Per-token log-probs and entropies of ``logits / (temperature + 1e-7)`` (TRL's scaling; float32).

    Args:
      logits: ``[B, L, V]`` raw policy logits at the response positions (``response_slice``).
      responses: ``[B, L]`` int.

    Returns:
      ``(logprobs [B, L], entropy [B, L])``: ``x[y] - logsumexp(x)`` and ``logsumexp(x) - sum softmax(x) x``.
      Example: logits ``log([0.25, 0.75])``, T 1 -> logprob of token 1 ``-0.2877``, entropy ``0.5623``.
    """
    x = scale_logits(logits, temperature)
    return per_token_logps(x, responses), entropy_from_logits(x)


def scale_logits(logits: Array, temperature: float) -> Array:
    """``float32(logits) / (temperature + 1e-7)``. TRL's rollout log-probs come from generation scores scaled so
    (its temperature warper gets ``temperature + 1e-7``), the reference and training logits are divided the same."""
    return logits.astype(jnp.float32) / (temperature + TEMPERATURE_EPS)


# ----------------------------------------------------------------------------------------------- rewards


def token_kl(logprobs: Array, ref_logprobs: Array, estimator: KLEstimator = "k1") -> Array:
    """TRL 1.12 PPO's per-token KL with ``logr = ref - logp``: k1 ``-logr``, k3 ``(exp(logr) - 1) - logr``.

    Both are 0 where ``logp == ref`` (e.g. padding, where both are ``INVALID_LOGPROB``). ``logp = log 0.5``,
    ``ref = log 0.25``: k1 ``0.6931``, k3 ``0.1931``. ``[B, L] -> [B, L]``.
    """
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        return (jnp.exp(logr) - 1) - logr
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def apply_missing_eos_penalty(
    scores: Array, postprocessed_responses: Array, eos_token_id: int, penalty: float | None
) -> tuple[Array, Array]:
    """``scores - penalty`` where the postprocessed response holds no ``eos_token_id``; also returns that flag.

    ``contain_eos = any(response == eos)`` (any position, after stop-token truncation). ``penalty=None``: scores
    unchanged. Scores ``[1, 1]``, rows ``[[4, eos], [4, 5]]``, penalty 2 -> ``[1, -1]``, ``[True, False]``.
    """
    contain_eos = jnp.any(postprocessed_responses == eos_token_id, axis=-1)
    if penalty is not None:
        scores = jnp.where(contain_eos, scores, scores - penalty)
    return scores, contain_eos


def score_positions(seq_lengths: Array, response_width: Array | int) -> Array:
    """Where TRL adds the score: ``len + 1`` (the first position after the response) if ``< W``, else ``len``.

    So a response that ended before TRL's width W gets its score one step *after* its last token (a pad position kept
    by ``padding_mask_p1``, whose value is the value model's output at the last token); one as wide as W at its last
    token. ``len [1, 3, -1], W 4 -> [2, 3, 0]``.
    """
    p1 = seq_lengths + 1
    return jnp.where(p1 < response_width, p1, seq_lengths)


def token_rewards(
    kl: Array, scores: Array, seq_lengths: Array, kl_coef: float, response_width: Array | int | None = None
) -> tuple[Array, Array]:
    """``(rewards, non_score_reward)``: ``non_score_reward = -kl_coef * kl``; ``rewards`` adds each row's score at
    ``score_positions`` (W defaults to L). kl ``[[0.1, 0.2, 0, 0]]``, score 1, len 1, coef 0.5 ->
    ``[[-0.05, -0.1, 1, 0]]``."""
    non_score_reward = -kl_coef * kl
    end = score_positions(seq_lengths, kl.shape[1] if response_width is None else response_width)
    rewards = non_score_reward.at[jnp.arange(kl.shape[0]), end].add(scores)
    return rewards, non_score_reward


# ----------------------------------------------------------------------------------------------- whitening, GAE


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """``sum(values * mask) / sum(mask)`` (TRL's PPO helper: no guard, an empty mask gives NaN)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(values * m, axis=axis) / jnp.sum(m, axis=axis)


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Masked variance over all entries, Bessel-corrected by ``n / (n - 1)`` with n = ``sum(mask)``.

    TRL raises on n = 0 (this returns NaN; n = 1 divides by 0 in both). ``[1, 2, 3, 99]``, mask ``[1, 1, 1, 0]`` ->
    ``1.0`` (biased: ``0.6667``).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = jnp.sum(mask.astype(jnp.float32))
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """``(x - mean) * rsqrt(var + 1e-8)`` with masked mean and unbiased masked variance over *all* entries (one
    statistic for the whole batch); ``shift_mean=False`` adds the mean back. Masked-out entries are transformed too
    (callers zero them). ``[1, 2, 3]`` (all kept) -> ``[-1, 0, 1]`` (up to 1e-8); ``shift_mean=False`` -> ``[1, 2, 3]``.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def gae(rewards: Array, values: Array, gamma: float, lam: float) -> tuple[Array, Array]:
    """Generalised advantage estimation over the whole response width, as a reverse ``lax.scan``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_L = 0``), ``A_t = delta_t + gamma * lam * A_{t+1}`` (``A_L = 0``),
    ``returns = A + V``. No mask: TRL relies on rewards and values being 0 past ``padding_mask_p1``.
    r ``[[0, 1]]``, V ``[[0.5, 0.2]]``, gamma 1, lam 0.5 -> A ``[[0.1, 0.8]]``, returns ``[[0.6, 1.0]]``.

    Args:
      rewards, values: ``[B, L]`` float32.

    Returns:
      ``(advantages [B, L], returns [B, L])``.
    """
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(last: Array, delta: Array) -> tuple[Array, Array]:
        last = delta + gamma * lam * last
        return last, last

    _, adv = jax.lax.scan(step, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    advantages = adv.T
    return advantages, advantages + values


# ----------------------------------------------------------------------------------------------- the rollout


def ppo_rollout(
    responses: Array,
    postprocessed_responses: Array,
    logprobs: Array,
    ref_logprobs: Array,
    values: Array,
    scores: Array,
    *,
    eos_token_id: int,
    pad_token_id: int,
    options: PPOOptions = PPOOptions(),
    response_width: Array | int | None = None,
) -> PPORollout:
    """TRL's rollout processing (``ppo_trainer.py`` 755-798), in its order.

    ``contain_eos`` and ``missing_eos_penalty`` -> ``sequence_lengths`` from the postprocessed responses -> padding
    masks -> log-probs and reference log-probs filled with ``INVALID_LOGPROB`` at ``padding_mask``, values with 0 at
    ``padding_mask_p1`` -> ``kl`` -> ``rewards`` -> (``whiten_rewards``: ``masked_whiten(rewards, ~padding_mask_p1,
    shift_mean=False)``, then 0 at ``padding_mask_p1``) -> ``gae`` -> ``returns`` -> advantages whitened over
    ``~padding_mask`` (shift_mean=True), then 0 at ``padding_mask``.

    Args:
      responses: ``[B, L]`` generated tokens (not truncated).
      postprocessed_responses: ``[B, L]``, ``truncate_response(responses, ...)`` (or ``responses``).
      logprobs: ``[B, L]`` rollout log-probs of ``responses`` (``policy_logprobs`` of the generation logits).
      ref_logprobs: ``[B, L]`` reference log-probs of ``responses``.
      values: ``[B, L]`` value-head outputs at the response positions, from ``query + responses``.
      scores: ``[B]`` reward-model scores of ``query + postprocessed_responses`` (before the EOS penalty).
      response_width: TRL's width W (``generated_width``) when the arrays are wider; None: W = L.
    """
    scores, contain_eos = apply_missing_eos_penalty(
        scores.astype(jnp.float32), postprocessed_responses, eos_token_id, options.missing_eos_penalty
    )
    seq_lengths = sequence_lengths(postprocessed_responses, pad_token_id)
    width = jnp.asarray(responses.shape[1] if response_width is None else response_width, jnp.int32)
    padding_mask, padding_mask_p1 = padding_masks(seq_lengths, responses.shape[1], width)
    logprobs = jnp.where(padding_mask, INVALID_LOGPROB, logprobs)
    ref_logprobs = jnp.where(padding_mask, INVALID_LOGPROB, ref_logprobs)
    values = jnp.where(padding_mask_p1, 0.0, values.astype(jnp.float32))

    kl = token_kl(logprobs, ref_logprobs, options.kl_estimator)
    rewards, non_score_reward = token_rewards(kl, scores, seq_lengths, options.kl_coef, width)
    if options.whiten_rewards:
        rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False)
        rewards = jnp.where(padding_mask_p1, 0.0, rewards)

    advantages, returns = gae(rewards, values, options.gamma, options.lam)
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = jnp.where(padding_mask, 0.0, advantages)
    return PPORollout(
        responses=responses, postprocessed_responses=postprocessed_responses, sequence_lengths=seq_lengths,
        contain_eos_token=contain_eos, padding_mask=padding_mask, padding_mask_p1=padding_mask_p1,
        logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores, kl=kl,
        non_score_reward=non_score_reward, rewards=rewards, advantages=advantages, returns=returns,
        response_width=jnp.full(responses.shape[:1], width, jnp.int32),
    )


# ----------------------------------------------------------------------------------------------- the loss


def ppo_loss(
    new_logprobs: Array,
    vpred: Array,
    batch: PPORollout,
    options: PPOOptions = PPOOptions(),
    entropy: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """One micro-batch's PPO loss and statistics (``ppo_trainer.py`` 820-868).

    - policy: ``ratio = exp(new - old)`` (new filled with ``INVALID_LOGPROB`` at padding, so ratio 1 there),
      ``pg_loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)), ~padding_mask)``;
    - value: ``vpred`` 0 at ``padding_mask_p1``, ``vclip = clip(vpred, V - cv, V + cv)``,
      ``vf_loss = 0.5 * masked_mean(max((vpred - R)^2, (vclip - R)^2), ~padding_mask_p1)``;
    - ``loss = pg_loss + vf_coef * vf_loss`` (TRL's backward then divides by ``gradient_accumulation_steps``).

    Statistics (no gradient): ``pg_clipfrac`` and ``vf_clipfrac`` (masked means of "the clipped term is larger"),
    and, over *all* b x W positions with padding included (TRL's tensors are W wide): ``approxkl =
    0.5 * mean((new - old)^2)``, ``ratio = mean(ratio)`` (1 at padding), ``entropy = mean(entropy)`` (when given).

    Args:
      new_logprobs: ``[b, L]`` current-policy log-probs of ``batch.responses`` (``policy_logprobs``), unmasked.
      vpred: ``[b, L]`` current value-head outputs at the response positions (``response_slice``), unmasked.
      batch: the rollout rows of this micro-batch (``jax.tree.map(lambda x: x[rows], rollout)``).
      entropy: ``[b, L]`` per-token entropies of the scaled logits, for the ``entropy`` statistic.

    Returns:
      ``(loss [], stats)`` with keys ``STAT_NAMES`` (``entropy`` only when given).
    """
    sg = jax.lax.stop_gradient
    pm, pm1 = batch.padding_mask, batch.padding_mask_p1
    new_logprobs = jnp.where(pm, INVALID_LOGPROB, new_logprobs)
    vpred = jnp.where(pm1, 0.0, vpred)
    old, values, returns, adv = sg(batch.logprobs), sg(batch.values), sg(batch.returns), sg(batch.advantages)

    vpredclipped = jnp.clip(vpred, values - options.cliprange_value, values + options.cliprange_value)
    vf_losses1 = jnp.square(vpred - returns)
    vf_losses2 = jnp.square(vpredclipped - returns)
    vf_loss = 0.5 * masked_mean(jnp.maximum(vf_losses1, vf_losses2), ~pm1)

    logprobs_diff = new_logprobs - old
    ratio = jnp.exp(logprobs_diff)
    pg_losses = -adv * ratio
    pg_losses2 = -adv * jnp.clip(ratio, 1.0 - options.cliprange, 1.0 + options.cliprange)
    pg_loss = masked_mean(jnp.maximum(pg_losses, pg_losses2), ~pm)
    loss = pg_loss + options.vf_coef * vf_loss

    within = jnp.arange(pm.shape[1])[None, :] < batch.response_width[:, None]  # TRL's W columns
    stats = {
        "approxkl": 0.5 * masked_mean(sg(logprobs_diff) ** 2, within),
        "pg_clipfrac": masked_mean(sg(pg_losses2 > pg_losses), ~pm),
        "pg_loss": sg(pg_loss),
        "vf_loss": sg(vf_loss),
        "vf_clipfrac": masked_mean(sg(vf_losses2 > vf_losses1), ~pm1),
        "ratio": masked_mean(sg(ratio), within),
    }
    if entropy is not None:
        stats["entropy"] = masked_mean(sg(entropy), within)
    return loss, stats


# ----------------------------------------------------------------------------------------------- batching (host side)


TABLE_METRICS = {"approxkl": "policy/approxkl_avg", "pg_clipfrac": "policy/clipfrac_avg", "pg_loss": "loss/policy_avg",
                 "vf_loss": "loss/value_avg", "vf_clipfrac": "val/clipfrac_avg", "entropy": "policy/entropy_avg",
                 "ratio": "val/ratio"}
"""TRL's logged name of the mean of each statistics table (``STAT_NAMES``)."""


def rollout_metrics(rollout: PPORollout, eos_token_id: int) -> dict[str, Array]:
    """The generation half of TRL's logged dict (``update_metrics``): ``objective/*`` and ``val/num_eos_tokens``."""
    not_pad = (~rollout.padding_mask).astype(jnp.float32)
    mean_non_score = jnp.mean(jnp.sum(rollout.non_score_reward, axis=1))
    mean_score = jnp.mean(rollout.scores)
    return {
        "objective/kl": jnp.mean(jnp.sum(rollout.kl, axis=1)),
        "objective/entropy": jnp.mean(jnp.sum(-rollout.logprobs * not_pad, axis=1)),
        "objective/non_score_reward": mean_non_score,
        "objective/rlhf_reward": mean_non_score + mean_score,
        "objective/scores": mean_score,
        "val/num_eos_tokens": jnp.sum(rollout.responses == eos_token_id),
    }


def table_metrics(stats: dict[str, Array]) -> dict[str, Array]:
    """The update half of TRL's logged dict (``update_metrics``): the mean of each statistics table (any shape,
    unwritten zeros included) under its ``TABLE_METRICS`` name, and ``val/ratio_var``, the ratio table's unbiased
    variance. Tables ``[[1, 3], [0, 0]]`` -> mean 1.0; as ratio: var 2.0."""
    out = {TABLE_METRICS[name]: jnp.mean(stats[name]) for name in STAT_NAMES if name in stats}
    out["val/ratio_var"] = jnp.var(stats["ratio"].ravel(), ddof=1)
    return out


def zero_filled_tables(micro: dict[str, Array], num_ppo_epochs: int, num_mini_batches: int,
                       gradient_accumulation_steps: int) -> dict[str, Array]:
    """Each statistic's per-micro-batch values (any shape, K in all) as TRL's ``[E, M, A]`` table holds them for
    its mean and variance: the K values and ``E * M * A - K`` zeros, flat (the positions do not matter to a mean
    or a variance; ``micro_stats_table`` places them). ``[0.5, 1.5]`` with E, M, A = 1, 2, 2 -> ``[0.5, 1.5, 0, 0]``.
    """
    cells = num_ppo_epochs * num_mini_batches * gradient_accumulation_steps
    out = {}
    for name, values in micro.items():
        flat = jnp.ravel(values).astype(jnp.float32)
        if flat.shape[0] > cells:
            raise ValueError(f"{flat.shape[0]} micro-batch values do not fit a {cells}-cell statistics table")
        out[name] = jnp.concatenate([flat, jnp.zeros(cells - flat.shape[0], jnp.float32)])
    return out


# ----------------------------------------------------------------------------------------------- the algorithm


@dataclasses.dataclass(frozen=True)
class PPO(PPOOptions):
    """TRL 1.12's PPO as the value the step composes (``rloo_jax.algorithms``): ``PPOOptions``' knobs, the sizes of
    TRL's statistics tables and the tokenizer's pad and EOS ids. Frozen and hashable (static for ``jax.jit``).

    - ``score`` (once per generation batch): ``ppo_rollout`` on the rollout's tokens, log-probs, reference
      log-probs and values, with the reward (the reward model's score and any reward functions', weighted) as
      TRL's score, and TRL's response width W (the longest completion, its stop token included) -> per-token
      advantages, returns, the rollout values and the two padding masks as the update's targets; TRL's
      ``objective/*`` and ``val/num_eos_tokens`` as metrics.
    - ``loss`` (one micro-batch): ``ppo_loss`` with the current log-probs, entropies and values; its statistics
      per micro-batch under TRL's logged names.
    - ``summarize`` (once per update): those statistics as TRL logs them (``table_metrics`` of the zero-filled
      ``[E, M, A]`` tables).

    The completion mask of the rollout is TRL's attention mask over the response: the step's sampler stops at the
    stop token (or never, without one) and pads after it, and every pad id counts as padding (``StepConfig.
    pad_is_padding``, TRL's ``ids != pad``), so the postprocessed response is the completion with pad outside the
    mask, cut at its first pad as TRL's ``sequence_lengths``.
    """

    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    gradient_accumulation_steps: int = 1
    pad_token_id: int = 0
    eos_token_id: int = 1
    stop_token_id: int | None = None
    """Where generation stopped (TRL's width W, ``generated_width``); None: never (every response full length)."""

    needs_values = True  # a value model: its per-token estimates at generation time and, trained, in the loss
    entropy_grad = False
    mask_truncated_completions = False
    step_unit = "generation"  # a step (the learning rate's, the log's) is one update over a generation batch

    @property
    def needs_reference(self) -> bool:
        return True  # TRL's KL penalty and objective/kl (kl_coef 0 still logs the KL)

    def rollout(self, batch: ScoreInputs) -> PPORollout:
        """``ppo_rollout`` of a generation batch (``[N, C]`` arrays; C may exceed TRL's width W, which is then
        passed as ``response_width``)."""
        mask = batch.mask > 0
        responses = batch.completion_ids
        post = jnp.where(mask, responses, jnp.asarray(self.pad_token_id, responses.dtype))
        scores = jnp.nan_to_num(combine_rewards(batch.rewards_per_func, batch.reward_weights), nan=0.0)
        width = generated_width(responses, self.stop_token_id)
        return ppo_rollout(responses, post, batch.old_logps, batch.ref_logps, batch.values, scores,
                           eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, options=self,
                           response_width=width)

    def score(self, batch: ScoreInputs) -> tuple[dict[str, Array], dict[str, Array]]:
        r = self.rollout(batch)
        targets = {"advantages": r.advantages, "returns": r.returns, "old_values": r.values,
                   "padding_mask": r.padding_mask, "padding_mask_p1": r.padding_mask_p1,
                   "response_width": r.response_width}
        return targets, rollout_metrics(r, self.eos_token_id)

    def loss(self, batch: LossInputs) -> tuple[Array, dict[str, Array], dict[str, Array]]:
        t = batch.targets
        pm = t["padding_mask"]
        rows = PPORollout(
            responses=None, postprocessed_responses=None, sequence_lengths=None, contain_eos_token=None,
            padding_mask=pm, padding_mask_p1=t["padding_mask_p1"],
            logprobs=jnp.where(pm, INVALID_LOGPROB, batch.old_logps), ref_logprobs=None, values=t["old_values"],
            scores=None, kl=None, non_score_reward=None, rewards=None, advantages=batch.advantages,
            returns=t["returns"], response_width=t["response_width"],
        )
        loss, stats = ppo_loss(batch.logps, batch.values, rows, self, entropy=batch.entropy)
        return loss, {TABLE_METRICS[name]: value for name, value in stats.items()}, {}

    def init_state(self) -> None:
        return None

    def next_state(self, state: None, stats: dict[str, Array]) -> tuple[None, dict[str, Array]]:
        return state, {}

    def record_advantages(self, advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """A completion's advantage as the rollout records show it: the mean of its tokens' ``[N, C] -> [N]``."""
        mask = np.asarray(mask, np.float32)
        return (np.asarray(advantages) * mask).sum(1) / np.maximum(mask.sum(1), 1.0)

    def summarize(self, metrics: dict[str, dict[str, Array]]) -> dict[str, dict[str, Array]]:
        """The update's record as TRL logs it: the generation metrics and ``table_metrics`` of the micro-batch
        statistics (``[U, M]`` each, K values) in their zero-filled ``[E, M, A]`` tables, into ``generation``."""
        names = {v: k for k, v in TABLE_METRICS.items()}
        micro = {names[n]: v for n, v in metrics["micro"].items() if n in names}
        tables = zero_filled_tables(micro, self.num_ppo_epochs, self.num_mini_batches, self.gradient_accumulation_steps)
        return dict(metrics, generation={**metrics["generation"], **table_metrics(tables)})
