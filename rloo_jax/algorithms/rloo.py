"""RLOO (TRL 1.16's ``RLOOTrainer``) as pure functions: rewards -> KL penalty in the reward -> leave-one-out
advantages -> sequence-level clipped objective; and ``RLOO``, the algorithm value the step composes.

Semantics follow TRL 1.16's ``RLOOTrainer`` exactly (see ``shared/DESIGN.md`` section 1). Rows of a batch are
grouped contiguously: rows ``g*G .. g*G+G-1`` are the G completions of prompt g.

Shapes: N = B*G completions (B prompts, G completions per prompt), C completion length, F reward functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.algorithms.common import (
    NORM_EPS,
    KLEstimator,
    LossInputs,
    ScoreInputs,
    combine_rewards,
    nanmean,
    nanstd,
    reward_metrics,
    token_kl,
)
from rloo_jax.logprobs import masked_mean

Array = jax.Array
Aggregation = Literal["grpo", "bnpo", "dr_grpo", "dapo"]


# ----------------------------------------------------------------------------------------------- advantages


def rloo_advantages(rewards: Array, num_generations: int) -> Array:
    """Leave-one-out advantages within contiguous groups of G: ``A_i = r_i - (sum_{j != i} r_j) / (n - 1)``.

    NaN (unscorable) rows are left out of their siblings' baselines (n counts the scorable rows of the group) and
    get NaN; a row that is the only scorable one of its group gets 0/0 = NaN. The caller zeroes NaN advantages.
    G == 1 gives 0 (no siblings).

    Args:
      rewards: ``[N]``, N a multiple of G.
      num_generations: G.

    Returns:
      ``[N]`` float32. Example: ``[1, 0, 2.5, -1]``, G=4 -> ``[0.5, -0.8333, 2.5, -2.1667]``.
    """
    chex.assert_rank(rewards, 1)
    if rewards.shape[0] % num_generations:
        raise ValueError(f"batch {rewards.shape[0]} is not a multiple of num_generations={num_generations}")
    r = rewards.astype(jnp.float32)
    if num_generations == 1:
        return jnp.zeros_like(r)
    g = r.reshape(-1, num_generations)
    valid = ~jnp.isnan(g)
    total = jnp.sum(jnp.where(valid, g, 0.0), axis=1, keepdims=True)
    n = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
    baseline = (total - g) / (n - 1.0)
    return (g - baseline).reshape(-1)


def normalize_advantages(advantages: Array) -> Array:
    """Batch-wide whitening ignoring NaN: ``(a - mean(a)) / (std(a, ddof=1) + 1e-4)``.

    Args:
      advantages: ``[N]``.

    Returns:
      ``[N]``; NaN entries stay NaN. Example: ``[1, 3]`` -> ``[-0.70706, 0.70706]``.
    """
    chex.assert_rank(advantages, 1)
    return (advantages - nanmean(advantages)) / (nanstd(advantages) + NORM_EPS)


# ----------------------------------------------------------------------------------------------- objective


def clipped_objective(
    per_token_logps: Array,
    old_per_token_logps: Array,
    advantages: Array,
    mask: Array,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    level: Literal["sequence", "token"] = "sequence",
    aggregation: Aggregation = "grpo",
    num_items: Array | None = None,
    importance_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO-style clipped surrogate: ``loss = -min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A)``.

    ``level="sequence"`` (TRL's RLOO): ``rho_i = exp(sum_t m_t (logp_t - old_t))``, loss = mean over sequences.
    ``level="token"`` (TRL's GRPO): ``rho_it = exp(logp_t - old_t)`` per token, aggregated by
    ``grpo`` (per-sequence token mean, then mean), ``bnpo`` (token mean over the batch), ``dr_grpo``
    (token sum / (N * C)) or ``dapo`` (token sum / ``num_items``, the token count of the whole generation batch;
    defaults to this batch's).

    Args:
      per_token_logps: ``[N, C]`` current policy (gradients flow through it).
      old_per_token_logps: ``[N, C]`` behaviour policy (treated as constant).
      advantages: ``[N]``.
      mask: ``[N, C]`` completion mask.
      epsilon, epsilon_high: clip range ``[1 - epsilon, 1 + epsilon_high]``; epsilon_high defaults to epsilon.
      importance_weights: ``[N]`` (or ``[N, C]`` at ``level="token"``), e.g. from ``importance_sampling_weights``:
        each sequence's (token's) loss is multiplied by it before aggregation, as TRL's GRPO does. No gradient.

    Returns:
      ``(loss [], metrics)``; metrics (TRL names): ``clip_ratio/low_mean``, ``clip_ratio/low_min``,
      ``clip_ratio/high_mean``, ``clip_ratio/high_max``, ``clip_ratio/region_mean``, plus ``ratio_mean`` and
      ``approx_kl`` (k3 of old vs current). Low clip = ``rho < 1 - eps and A < 0``; high = ``rho > 1 + eps_high
      and A > 0``.
    """
    chex.assert_equal_shape((per_token_logps, old_per_token_logps, mask))
    chex.assert_shape(advantages, (per_token_logps.shape[0],))
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = mask.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_per_token_logps)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    log_ratio = (per_token_logps - old) * m

    if level == "sequence":
        log_ratio = jnp.sum(log_ratio, axis=1)  # [N]
        a, valid = adv, jnp.ones_like(adv)
    elif level == "token":
        a, valid = adv[:, None], m
    else:
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    ratio = jnp.exp(log_ratio)
    loss_each = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * a)
    if importance_weights is not None:
        w = jax.lax.stop_gradient(importance_weights.astype(jnp.float32))
        if level == "sequence":
            chex.assert_shape(w, (per_token_logps.shape[0],))
        elif w.ndim == 1:
            w = w[:, None]
        loss_each = loss_each * w

    if level == "sequence":
        loss = jnp.mean(loss_each)
    elif aggregation == "grpo":
        loss = jnp.mean(masked_mean(loss_each, m, axis=1))
    elif aggregation == "bnpo":
        loss = masked_mean(loss_each, m)
    elif aggregation == "dr_grpo":
        loss = jnp.sum(loss_each * m) / (m.shape[0] * m.shape[1])
    elif aggregation == "dapo":
        denom = jnp.sum(m) if num_items is None else num_items
        loss = jnp.sum(loss_each * m) / jnp.maximum(denom, 1.0)
    else:
        raise ValueError(f"aggregation must be one of grpo, bnpo, dr_grpo, dapo; got {aggregation!r}")

    ratio = jax.lax.stop_gradient(ratio)
    low = ((ratio < 1.0 - eps_low) & (a < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + eps_high) & (a > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    lr = jax.lax.stop_gradient(log_ratio)
    if level == "sequence":
        means = lambda x: jnp.mean(x)  # noqa: E731
        low_min, high_max = jnp.min(low), jnp.max(high)
    else:
        means = lambda x: masked_mean(x, valid)  # noqa: E731
        low_min = jnp.min(jnp.where(valid > 0, low, 1.0))
        high_max = jnp.max(jnp.where(valid > 0, high, 0.0))
    metrics = {
        "clip_ratio/low_mean": means(low),
        "clip_ratio/low_min": low_min,
        "clip_ratio/high_mean": means(high),
        "clip_ratio/high_max": high_max,
        "clip_ratio/region_mean": means(region),
        "ratio_mean": means(ratio),
        "approx_kl": means(jnp.exp(-lr) - 1.0 + lr),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------- end to end


def score_completions(
    rewards_per_func: Array,
    completion_mask: Array,
    is_truncated: Array,
    old_per_token_logps: Array | None,
    ref_per_token_logps: Array | None,
    *,
    num_generations: int,
    reward_weights: Array | None = None,
    options: RLOO | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Generation-time half of TRL's RLOO: rewards -> (clip) -> KL penalty -> leave-one-out -> (normalise).

    ``r = combine_rewards(R, w)`` (NaN when unscorable); ``r -= missing_eos_penalty`` where truncated;
    ``r = clip(r, *reward_clip_range)``; ``r -= beta * sequence_kl(old, ref, mask)`` (k1 by default, no gradient);
    ``A = rloo_advantages(r, G)``; optional ``normalize_advantages``; NaN advantages -> 0.

    Args:
      rewards_per_func: ``[N, F]`` with NaN for None.
      completion_mask: ``[N, C]`` (already zeroed for truncated rows when ``mask_truncated_completions``).
      is_truncated: ``[N]`` bool.
      old_per_token_logps: ``[N, C]`` generation-time policy log-probs (needed when beta > 0).
      ref_per_token_logps: ``[N, C]`` reference log-probs, or None when beta == 0.
      options: the ``RLOO`` knobs (default ``RLOO()``).

    Returns:
      ``(advantages [N], metrics)`` with TRL's names ``reward``, ``reward_std``, ``kl`` (masked token mean),
      ``frac_reward_zero_std``, ``rewards/<f>/mean|std`` (f = function index), ``advantage_abs_mean``.
    """
    options = RLOO() if options is None else options
    chex.assert_rank(rewards_per_func, 2)
    mask = completion_mask.astype(jnp.float32)
    rewards = combine_rewards(rewards_per_func, reward_weights)
    if options.missing_eos_penalty is not None:
        rewards = rewards - options.missing_eos_penalty * is_truncated.astype(jnp.float32)
    if options.reward_clip_range is not None:
        lo, hi = options.reward_clip_range
        rewards = jnp.clip(rewards, lo, hi)

    metrics: dict[str, Array] = {}
    if options.beta != 0.0:
        if old_per_token_logps is None or ref_per_token_logps is None:
            raise ValueError("beta != 0 needs old_per_token_logps and ref_per_token_logps")
        per_token = token_kl(old_per_token_logps, ref_per_token_logps, options.kl_estimator)
        metrics["kl"] = jax.lax.stop_gradient(jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0))
        if options.kl_in_reward:
            rewards = rewards - options.beta * jax.lax.stop_gradient(jnp.sum(per_token * mask, axis=-1))

    grouped = rewards.reshape(-1, num_generations)
    if num_generations > 1:
        group_std = nanstd(grouped, axis=1)
    else:
        group_std = jnp.zeros(grouped.shape[0], jnp.float32)
    adv = rloo_advantages(rewards, num_generations)
    if options.normalize_advantages:
        adv = normalize_advantages(adv)
    adv = jnp.nan_to_num(adv, nan=0.0)
    metrics.update(reward_metrics(rewards_per_func, reward_weights, group_std))
    metrics["advantage_abs_mean"] = jnp.mean(jnp.abs(adv))
    return adv, metrics


def rloo_loss(
    per_token_logps: Array,
    old_per_token_logps: Array | None,
    ref_per_token_logps: Array | None,
    rewards_per_func: Array,
    completion_mask: Array,
    is_truncated: Array,
    *,
    num_generations: int,
    reward_weights: Array | None = None,
    options: RLOO | None = None,
    importance_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """TRL 1.16's RLOO end to end on one batch: ``score_completions`` then ``clipped_objective``.

    ``old_per_token_logps=None`` means on-policy (``num_iterations == 1``): old = stop_gradient(current), so the
    ratio is exactly 1. Truncated rows get an all-zero mask when ``mask_truncated_completions`` (their reward still
    enters their siblings' baselines and they still count in the loss mean). Gradients flow only through
    ``per_token_logps`` (and through the KL term when ``token_level_kl``).

    Args:
      per_token_logps: ``[N, C]`` current policy log-probs.
      old_per_token_logps: ``[N, C]`` or None.
      ref_per_token_logps: ``[N, C]`` or None (beta == 0).
      rewards_per_func: ``[N, F]`` (NaN = None).
      completion_mask: ``[N, C]``; is_truncated: ``[N]``.
      importance_weights: optional sampler/trainer correction (``importance_sampling_weights``), passed to
        ``clipped_objective``.

    Returns:
      ``(loss [], metrics)``: the union of ``score_completions`` and ``clipped_objective`` metrics, plus ``loss``.
    """
    options = RLOO() if options is None else options
    mask = completion_mask.astype(jnp.float32)
    if options.mask_truncated_completions:
        mask = mask * (~is_truncated)[:, None].astype(jnp.float32)
    old = jax.lax.stop_gradient(per_token_logps if old_per_token_logps is None else old_per_token_logps)
    ref = None if ref_per_token_logps is None else jax.lax.stop_gradient(ref_per_token_logps)
    adv, metrics = score_completions(
        rewards_per_func,
        mask,
        is_truncated,
        old,
        ref,
        num_generations=num_generations,
        reward_weights=reward_weights,
        options=options,
    )
    loss, obj_metrics = clipped_objective(
        per_token_logps,
        old,
        adv,
        mask,
        epsilon=options.epsilon,
        epsilon_high=options.epsilon_high,
        level=options.level,
        aggregation=options.aggregation,
        importance_weights=importance_weights,
    )
    if options.beta != 0.0 and options.token_level_kl:
        loss = loss + options.beta * kl_loss(per_token_logps, ref, mask, options.kl_estimator)
    metrics.update(obj_metrics)
    metrics["loss"] = loss
    return loss, metrics


def kl_loss(per_token_logps: Array, ref_per_token_logps: Array, mask: Array, estimator: KLEstimator = "k3") -> Array:
    """KL-in-loss term (``token_level_kl``): mean over sequences of the masked token mean of ``token_kl``.

    Gradients flow through ``per_token_logps``. Returns a scalar.
    """
    per_token = token_kl(per_token_logps, jax.lax.stop_gradient(ref_per_token_logps), estimator)
    return jnp.mean(masked_mean(per_token, mask, axis=1))


# ----------------------------------------------------------------------------------------------- the algorithm


@dataclasses.dataclass(frozen=True)
class RLOO:
    """TRL 1.16's RLOO as the value the step composes: its knobs (TRL ``RLOOConfig`` names; frozen and hashable,
    so it can be a static argument of ``jax.jit``) and its two functions, ``score`` (generation time: rewards and
    the KL penalty -> leave-one-out advantages) and ``loss`` (one micro-batch: the clipped objective)."""

    beta: float = 0.05
    """KL coefficient; the penalty ``beta * KL`` is subtracted from the reward (0 disables the reference)."""
    epsilon: float = 0.2
    epsilon_high: float | None = None
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None
    mask_truncated_completions: bool = False
    """Truncated completions (no EOS) get an all-zero mask; their reward still enters their siblings' baselines."""
    missing_eos_penalty: float | None = None
    """Old TRL: subtracted from the score of completions that did not end with EOS."""
    kl_estimator: KLEstimator = "k1"
    token_level_kl: bool = False
    """False (TRL 1.16): the sequence KL is a reward penalty. True: the per-token KL (``kl_estimator``) is added to the
    loss instead, ``beta * mean_tokens(token_kl)``, with its gradient (GRPO-style KL-in-loss)."""
    level: Literal["sequence", "token"] = "sequence"
    aggregation: Aggregation = "grpo"

    needs_values = False  # no value model
    entropy_grad = False  # the loss does not differentiate the entropy
    step_unit = "optimizer"  # a step is an optimizer step (TRL's Trainer)

    @property
    def kl_in_reward(self) -> bool:
        return self.beta != 0.0 and not self.token_level_kl

    @property
    def needs_reference(self) -> bool:
        """Reference log-probs at generation time (beta != 0); beta == 0 loads no reference at all."""
        return self.beta != 0.0

    def score(self, batch: ScoreInputs) -> tuple[dict[str, Array], dict[str, Array]]:
        """``score_completions``: ``({"advantages": [N]}, metrics)``."""
        adv, metrics = score_completions(
            batch.rewards_per_func, batch.mask, batch.is_truncated, batch.old_logps, batch.ref_logps,
            num_generations=batch.num_generations, reward_weights=batch.reward_weights, options=self,
        )
        return {"advantages": adv}, metrics

    def loss(self, batch: LossInputs) -> tuple[Array, dict[str, Array], dict[str, Array]]:
        """``clipped_objective`` on one micro-batch (+ ``beta * kl_loss`` with ``token_level_kl``); the sampler/
        trainer correction ``batch.is_weights`` scales each sequence's (token's) loss. No state to update."""
        loss, metrics = clipped_objective(
            batch.logps, batch.old_logps, batch.advantages, batch.mask, self.epsilon, self.epsilon_high, self.level,
            self.aggregation, importance_weights=batch.is_weights,
        )
        if self.beta != 0.0 and self.token_level_kl:
            loss = loss + self.beta * kl_loss(batch.logps, batch.ref_logps, batch.mask, self.kl_estimator)
        return loss, metrics, {}

    def init_state(self) -> Any:
        return None

    def next_state(self, state: Any, stats: dict[str, Array]) -> tuple[Any, dict[str, Array]]:
        return state, {}

    def record_advantages(self, advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """A completion's advantage as the rollout records show it: ``[N]`` as scored."""
        return advantages

    def summarize(self, metrics: dict[str, dict[str, Array]]) -> dict[str, dict[str, Array]]:
        return metrics  # logged per optimizer step as they are (rloo_jax.logwindow)


RLOOOptions = RLOO  # the research API's earlier name
