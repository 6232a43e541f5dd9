"""GRPO (TRL 1.16's ``GRPOTrainer``) as pure functions, and ``GRPO``, the algorithm value the step composes.

Generation time: group-relative advantages (``group_advantages``: the group mean subtracted, scaled by the group's
or the batch's std or not at all; several reward functions summed then normalised, or normalised then summed).
Per micro-batch: the per-token loss of one of TRL's eight ``loss_type``s (``per_token_loss``), the optional masks
(off-policy sequences, ``off_policy_mask``; low-entropy tokens, ``entropy_mask``), the k3 KL to the reference *in
the loss* (``grpo_kl``), the aggregation over tokens (``aggregate``) and the entropy bonus with its adaptive
coefficient (``adaptive_entropy_coef``). ``GRPO.loss`` composes them in TRL's order (``GRPOTrainer._compute_loss``).

Shapes: N = B*G completions, n rows of a micro-batch, C completion length, F reward functions. Per-token tensors
are ``[n, C]``; with ``importance_sampling_level="sequence"`` the ratio and what derives from it are ``[n, 1]`` and
broadcast over the tokens, as in TRL.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.algorithms.common import (
    NORM_EPS,
    LossInputs,
    ScoreInputs,
    masked_max,
    masked_min,
    nanmean,
    nanstd,
    reward_metrics,
    token_kl,
)
from rloo_jax.logprobs import masked_mean

Array = jax.Array
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = LossType.__args__
ScaleRewards = Literal["group", "batch", "none"]
MultiObjective = Literal["sum_then_normalize", "normalize_then_sum"]
Level = Literal["token", "sequence"]
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-style clipped surrogate
_LOG_1E8 = math.log(1e-8)  # VESPO's lower clamp of log-weights


# ----------------------------------------------------------------------------------------------- advantages


def group_advantages(
    rewards_per_func: Array,
    reward_weights: Array,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    multi_objective_aggregation: MultiObjective = "sum_then_normalize",
) -> tuple[Array, Array]:
    """GRPO's advantages from the reward table, as TRL 1.16 computes them.

    ``sum_then_normalize``: ``r = sum_f w_f R_f`` (NaN entries skipped; a row with no reward stays NaN),
    ``A = r - mean_group(r)``, divided by ``std + 1e-4`` where ``std`` is the group's (``scale_rewards="group"``)
    or the batch's (``"batch"``) ddof-1 std; ``"none"`` does not divide (Dr. GRPO).
    ``normalize_then_sum`` (GDPO): each function normalised within its group, ``(R_f - mean) / (std + 1e-4)``, then
    ``r = sum_f w_f R_f'``, ``A = (r - mean(r)) / (std_batch(r) + 1e-4)``. NaN advantages (unscorable rows) -> 0.

    Args:
      rewards_per_func: ``[N, F]``, NaN where a function returned None.
      reward_weights: ``[F]``.
      num_generations: G (N a multiple of G).

    Returns:
      ``(advantages [N], std [N])``: ``std`` is the standard deviation each row was (or, with ``"none"``, would have
      been: the group's) scaled by, for TRL's ``frac_reward_zero_std``. Example: rewards ``[[1], [3], [0], [0]]``,
      G=2: group -> ``[-0.7071, 0.7071, 0, 0]`` (1/(1.4142+1e-4) = 0.70706), std ``[1.414, 1.414, 0, 0]``;
      none -> ``[-1, 1, 0, 0]``.
    """
    chex.assert_rank(rewards_per_func, 2)
    r = rewards_per_func.astype(jnp.float32)
    w = jnp.asarray(reward_weights, jnp.float32)
    n, g = r.shape[0], num_generations
    if n % g:
        raise ValueError(f"batch {n} is not a multiple of num_generations={g}")
    unscorable = jnp.all(jnp.isnan(r), axis=1)

    def weighted_sum(x: Array) -> Array:
        total = jnp.sum(jnp.where(jnp.isnan(x), 0.0, x * w), axis=1)
        return jnp.where(unscorable, jnp.nan, total)

    if multi_objective_aggregation == "sum_then_normalize":
        rewards = weighted_sum(r)
        grouped = rewards.reshape(-1, g)
        mean = jnp.repeat(nanmean(grouped, axis=1), g)
        if scale_rewards in ("group", "none"):
            std = jnp.repeat(nanstd(grouped, axis=1), g) if g > 1 else jnp.zeros_like(rewards)
        elif scale_rewards == "batch":
            std = jnp.broadcast_to(nanstd(rewards), rewards.shape) if n > 1 else jnp.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + NORM_EPS)
    elif multi_objective_aggregation == "normalize_then_sum":
        grouped = r.reshape(-1, g, r.shape[1])
        mean_k = nanmean(grouped, axis=1, keepdims=True)
        std_k = nanstd(grouped, axis=1, keepdims=True) if g > 1 else jnp.zeros_like(mean_k)
        rewards = weighted_sum(((grouped - mean_k) / (std_k + NORM_EPS)).reshape(n, -1))
        std = jnp.broadcast_to(nanstd(rewards), rewards.shape) if n > 1 else jnp.zeros_like(rewards)
        adv = (rewards - nanmean(rewards)) / (std + NORM_EPS)
    else:
        raise ValueError("multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', got "
                         f"{multi_objective_aggregation!r}")
    return jnp.nan_to_num(adv, nan=0.0), std


def grpo_advantages(rewards: Array, num_generations: int, scale: ScaleRewards = "group") -> Array:
    """GRPO's group-relative advantages of one reward per row: ``A_i = (r_i - mean_group(r)) / (std + 1e-4)``
    (``group_advantages`` with one function of weight 1; NaN rows -> 0).

    Args:
      rewards: ``[N]``.
      num_generations: G.

    Returns:
      ``[N]`` float32. Example: ``[1, 3, 0, 0]``, G=2, "none" -> ``[-1, 1, 0, 0]``.
    """
    chex.assert_rank(rewards, 1)
    return group_advantages(rewards[:, None], jnp.ones(1), num_generations, scale)[0]


# ----------------------------------------------------------------------------------------------- per-token loss


def importance_ratio(log_ratio: Array, mask: Array, level: Level) -> Array:
    """``exp`` of the log importance weight: per token ``log_ratio`` (``[n, C]``), or per sequence its masked mean
    ``sum_t m_t log_ratio_t / max(sum_t m_t, 1)`` (``[n, 1]``, GSPO). Gradients flow through it.

    Example: log_ratio ``[[0.2, 0.4]]``, mask ``[[1, 1]]``: token -> ``[[1.2214, 1.4918]]``; sequence ->
    ``[[1.3499]]``.
    """
    if level == "token":
        return jnp.exp(log_ratio)
    if level == "sequence":
        m = mask.astype(jnp.float32)
        return jnp.exp(jnp.sum(log_ratio * m, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True),
                                                                                     1.0))
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


def gamma_weights(
    advantages: Array,
    log_ratio: Array,
    mask: Array,
    importance_weights: Array | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> Array:
    """VESPO's sequence weights ``phi(w) = exp(lambda + k log w - lambda w)`` (``phi(1) = 1``), no gradient.

    ``log w = clip(sum_t m_t clip(log_ratio_t, -20, 20) + sum_t clip(log rho_t, log 1e-8, 20), log 1e-8, 20)`` with
    the sampler/trainer weights ``rho`` (token level, summed over every position as TRL does) when given; ``k``,
    ``lambda`` are the ``_pos`` values where ``A >= 0``, else ``_neg`` (lambda at least 1e-4); non-finite -> 0.

    Args:
      advantages: ``[n, 1]``; log_ratio, mask: ``[n, C]``; importance_weights: ``[n, C]`` or None.

    Returns:
      ``[n, 1]``. Example: log w = 0 -> 1 for either sign; A >= 0, log w = log 2 -> exp(3 + 2 log 2 - 6) = 0.1991.
    """
    m = mask.astype(jnp.float32)
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * m, axis=-1, keepdims=True)
    if importance_weights is not None:
        seq = seq + jnp.sum(jnp.clip(jnp.log(importance_weights), _LOG_1E8, 20.0), axis=-1, keepdims=True)
    log_w = jnp.clip(seq, _LOG_1E8, 20.0)
    pos = advantages >= 0
    k = jnp.where(pos, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(pos, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(phi), phi, 0.0))


def per_token_loss(
    logps: Array,
    coef_1: Array,
    advantages: Array,
    loss_type: LossType,
    epsilon_low: float,
    epsilon_high: float,
    *,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    phi: Array | None = None,
) -> tuple[Array, Array]:
    """The policy term of each token for ``loss_type`` (TRL 1.16), before masking and aggregation.

    With ratio ``r = coef_1`` and advantage ``A`` (``[n, 1]`` or ``[n, C]``):

    - grpo, bnpo, dr_grpo, dapo, luspo: ``-min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with
      ``r' = min(r, delta)`` when ``delta`` is set (two-sided clipping, INTELLECT-2);
    - cispo: ``-sg(min(r, eps_high)) A logp`` (clipped importance weight, no gradient through it; MiniMax-M1);
    - sapo: ``-sigmoid(tau (r - 1)) 4 / tau A``, ``tau`` = sapo_temperature_pos where ``A > 0`` else _neg;
    - vespo: ``-phi A logp`` (``gamma_weights``).

    Returns:
      ``(loss, ratio_for_metrics)``: the per-token loss (``[n, C]`` or ``[n, 1]``) and the ratio the clip metrics
      read (``r'`` for the clipped family, else ``r``). Example: r = 1.5, A = 1, eps 0.2: -1.2 (clipped); A = -1:
      1.5; with delta 1.4 and A = -1: 1.4.
    """
    if loss_type == "cispo":
        return -jax.lax.stop_gradient(jnp.minimum(coef_1, epsilon_high)) * advantages * logps, coef_1
    if loss_type in CLIPPED:
        coef_2 = jnp.clip(coef_1, 1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:
            coef_1 = jnp.minimum(coef_1, delta)
        return -jnp.minimum(coef_1 * advantages, coef_2 * advantages), coef_1
    if loss_type == "sapo":
        tau = jnp.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        return -jax.nn.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau * advantages, coef_1
    if loss_type == "vespo":
        if phi is None:
            raise ValueError("loss_type 'vespo' needs the gamma weights phi")
        return -phi * advantages * logps, coef_1
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")


def grpo_kl(logps: Array, ref_logps: Array, coef_1: Array | None = None) -> Array:
    """GRPO's per-token KL to the reference, in the loss: k3 ``exp(ref - logp) - (ref - logp) - 1``, times the
    (differentiable) importance ratio ``coef_1`` when given (``use_bias_correction_kl``: the unbiased reverse-KL
    gradient off-policy, DeepSeek-V3.2). Gradients flow through ``logps``. Example: logp - ref = log 2 -> 0.1931."""
    kl = token_kl(logps, jax.lax.stop_gradient(ref_logps), "k3")
    return kl if coef_1 is None else kl * coef_1


def off_policy_mask(advantages: Array, logps: Array, sampler_logps: Array, mask: Array, threshold: float) -> Array:
    """DeepSeek-V3.2's off-policy sequence mask: keep a sequence when ``A >= 0`` or its mean token KL
    ``sum_t m_t (sampler_t - logp_t) / max(sum_t m_t, 1) <= threshold`` (NaN differences count 0); ``[n, 1]`` float.

    Example: A ``[[-1], [1]]``, mean KL 0.6 and 0.6, threshold 0.5 -> ``[[0], [1]]``.
    """
    m = mask.astype(jnp.float32)
    kl = jnp.nan_to_num(sampler_logps - jax.lax.stop_gradient(logps), nan=0.0)
    mean_kl = jnp.sum(kl * m, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).astype(jnp.float32)


def entropy_mask(entropy: Array, mask: Array, top_quantile: float) -> Array:
    """Tokens in the top ``top_quantile`` of entropy (Beyond the 80/20 rule): ``H_t >= quantile(H[mask], 1 - q)``
    (linear interpolation, as ``torch.quantile``) and inside the mask; ``[n, C]`` float. No masked token: all 0.

    Example: entropies ``[[1, 2, 3, 4]]``, q 0.5 -> threshold 2.5 -> ``[[0, 0, 1, 1]]``.
    """
    h = jax.lax.stop_gradient(entropy.astype(jnp.float32))
    m = mask > 0
    threshold = jnp.nanquantile(jnp.where(m, h, jnp.nan), 1.0 - top_quantile, method="linear")
    return ((h * m >= threshold) & m).astype(jnp.float32)


def aggregate(
    loss: Array, mask: Array, loss_type: LossType, max_completion_length: int, num_items: Array | None = None
) -> Array:
    """A micro-batch's loss from its per-token terms ``loss`` (``[n, C]``, or ``[n, 1]`` broadcast) and ``mask``:

    - grpo, sapo: mean over sequences of each sequence's token mean;
    - bnpo: token mean over the micro-batch;
    - dr_grpo: token sum / (n * max_completion_length);
    - dapo, cispo, vespo: token sum / ``num_items`` (the completion tokens of the whole generation batch divided by
      the micro-batches it is cut into, so the gradient of an optimizer step is its token sum over the generation
      batch's tokens per step, as TRL's ``num_items_in_batch`` normalisation; None: this micro-batch's tokens);
    - luspo: mean over sequences of each sequence's token sum (longer sequences weigh more).

    Example: loss ``[[1, 1], [2, 0]]`` with mask ``[[1, 1], [1, 0]]``: grpo 1.5, bnpo 4/3, dr_grpo (C=2) 1.0,
    dapo 4/3 (num_items None), luspo 2.0.
    """
    m = mask.astype(jnp.float32)
    total = loss * m
    if loss_type in ("grpo", "sapo"):
        return jnp.mean(jnp.sum(total, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0))
    if loss_type == "bnpo":
        return jnp.sum(total) / jnp.maximum(jnp.sum(m), 1.0)
    if loss_type == "dr_grpo":
        return jnp.sum(total) / (m.shape[0] * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        return jnp.sum(total) / (jnp.maximum(jnp.sum(m), 1.0) if num_items is None else num_items)
    if loss_type == "luspo":
        return jnp.mean(jnp.sum(total, axis=-1))
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")


def adaptive_entropy_coef(
    coef: Array, entropy: Array, target: float, delta: float, coef_min: float, coef_max: float
) -> Array:
    """Skywork-OR1's controller, after each optimizer step: ``min(coef + delta, max)`` when the step's mean entropy
    is at or below ``target``, else ``max(coef - delta, min)``. Example: coef 0.01, entropy 0.1, target 0.2, delta
    0.005 -> 0.015; entropy 0.3 -> 0.005."""
    return jnp.where(entropy <= target, jnp.minimum(coef + delta, coef_max), jnp.maximum(coef - delta, coef_min))


# ----------------------------------------------------------------------------------------------- the algorithm


@dataclasses.dataclass(frozen=True)
class GRPO:
    """TRL 1.16's GRPO as the value the step composes: its knobs (TRL ``GRPOConfig`` names and defaults; frozen and
    hashable) and its functions, ``score`` (generation time: group-relative advantages) and ``loss`` (one
    micro-batch: the chosen ``loss_type``, masks, KL in the loss, entropy bonus), with the adaptive entropy
    coefficient as its state (``init_state`` / ``next_state``)."""

    beta: float = 0.0
    """KL coefficient of the k3 KL term in the loss; 0 (TRL's default) loads no reference model."""
    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: Level = "token"
    scale_rewards: ScaleRewards = "group"
    multi_objective_aggregation: MultiObjective = "sum_then_normalize"
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None
    """dr_grpo's constant; None: the completions' width."""

    needs_values = False
    step_unit = "optimizer"  # a step is an optimizer step (TRL's Trainer)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    @property
    def entropy_bonus(self) -> bool:
        """TRL's ``_entropy_bonus_enabled``: a non-zero coefficient, or adaptive control (which may raise it)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @property
    def entropy_grad(self) -> bool:
        return self.entropy_bonus

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def score(self, batch: ScoreInputs) -> tuple[dict[str, Array], dict[str, Array]]:
        """``group_advantages``: ``({"advantages": [N]}, TRL's reward metrics)`` (GRPO logs its KL in the loss)."""
        adv, std = group_advantages(batch.rewards_per_func, batch.reward_weights, batch.num_generations,
                                    self.scale_rewards, self.multi_objective_aggregation)
        metrics = reward_metrics(batch.rewards_per_func, batch.reward_weights, std)
        metrics["advantage_abs_mean"] = jnp.mean(jnp.abs(adv))
        return {"advantages": adv}, metrics

    def init_state(self) -> dict[str, Array]:
        """The entropy controller: the coefficient and the last optimizer step's mean entropy (the largest float32
        before a first measurement: no bonus until then, as TRL's inf; finite, so checkpoints take it)."""
        return {"entropy_coef": jnp.asarray(self.entropy_coef, jnp.float32),
                "last_entropy": jnp.asarray(jnp.finfo(jnp.float32).max, jnp.float32)}

    def init_stats(self) -> dict[str, Array]:
        """Zero ``loss`` statistics, the sum an optimizer step begins from (``rloo_jax.step.Accumulator``)."""
        if not self.entropy_bonus:
            return {}
        return {"entropy_sum": jnp.zeros((), jnp.float32), "entropy_count": jnp.zeros((), jnp.float32)}

    def next_state(self, state: dict[str, Array], stats: dict[str, Array]) -> tuple[dict[str, Array], dict]:
        """After an optimizer step: the adaptive update from the step's token-weighted mean entropy (``stats``: its
        sum and count over the step's micro-batches); returns ``(state, step metrics)`` (``entropy_coef``)."""
        if not self.entropy_bonus:
            return state, {}
        if self.use_adaptive_entropy:
            entropy = stats["entropy_sum"] / jnp.maximum(stats["entropy_count"], 1.0)
            coef = adaptive_entropy_coef(state["entropy_coef"], entropy, self.entropy_target, self.entropy_coef_delta,
                                         self.entropy_coef_min, self.entropy_coef_max)
            state = {"entropy_coef": coef, "last_entropy": entropy}
        return state, {"entropy_coef": state["entropy_coef"]}

    def record_advantages(self, advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """A completion's advantage as the rollout records show it: ``[N]`` as scored."""
        return advantages

    def summarize(self, metrics: dict[str, dict[str, Array]]) -> dict[str, dict[str, Array]]:
        return metrics  # logged per optimizer step as they are (rloo_jax.logwindow)

    def loss(self, batch: LossInputs) -> tuple[Array, dict[str, Array], dict[str, Array]]:
        """TRL 1.16's ``_compute_loss`` on one micro-batch: ratio -> KL -> per-token loss -> off-policy, entropy
        and sampler/trainer masks -> + beta KL -> aggregation -> - entropy bonus."""
        logps, mask = batch.logps, batch.mask
        adv = batch.advantages[:, None] if batch.advantages.ndim == 1 else batch.advantages
        log_ratio = logps - batch.old_logps
        coef_1 = importance_ratio(log_ratio, mask, self.importance_sampling_level)
        metrics: dict[str, Array] = {}
        kl = None
        if self.beta != 0.0:
            kl = grpo_kl(logps, batch.ref_logps, coef_1 if self.use_bias_correction_kl else None)
            metrics["kl"] = masked_mean(kl, mask)
        is_weights = batch.is_weights
        if is_weights is not None and is_weights.ndim == 1:
            is_weights = is_weights[:, None]
        phi = None
        if self.loss_type == "vespo":
            token_is = is_weights if is_weights is not None and is_weights.shape == logps.shape else None
            phi = gamma_weights(adv, log_ratio, mask, token_is, self.vespo_k_pos, self.vespo_lambda_pos,
                                self.vespo_k_neg, self.vespo_lambda_neg)
        loss, ratio = per_token_loss(
            logps, coef_1, adv, self.loss_type, self.epsilon_low, self.resolved_epsilon_high, delta=self.delta,
            sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg, phi=phi,
        )
        if self.off_policy_mask_threshold is not None:
            sampled = batch.old_logps if batch.sampler_logps is None else batch.sampler_logps
            loss = loss * off_policy_mask(adv, logps, sampled, mask, self.off_policy_mask_threshold)
        high = None
        if self.top_entropy_quantile < 1.0:
            high = entropy_mask(batch.entropy, mask, self.top_entropy_quantile)
            loss = loss * high
        if is_weights is not None and self.loss_type != "vespo":
            loss = loss * is_weights
        if kl is not None:
            loss = loss + self.beta * kl
        width = self.max_completion_length or mask.shape[1]
        total = aggregate(loss, mask, self.loss_type, width, batch.num_items)
        metrics.update(self._ratio_metrics(ratio, adv, mask, phi))
        stats: dict[str, Array] = {}
        if self.entropy_bonus:
            effective = mask if high is None else mask * high
            entropy_sum, count = jnp.sum(batch.entropy * effective), jnp.sum(effective)
            bonus = entropy_sum / jnp.maximum(count, 1.0)
            state = batch.algo_state
            coef = state["entropy_coef"]
            if self.use_adaptive_entropy:
                coef = jnp.where(state["last_entropy"] <= self.entropy_target, coef, 0.0)
            metrics["policy_loss"] = jax.lax.stop_gradient(total)
            total = total - coef * bonus
            stats = {"entropy_sum": jax.lax.stop_gradient(entropy_sum), "entropy_count": count}
        return total, metrics, stats

    def _ratio_metrics(self, ratio: Array, adv: Array, mask: Array, phi: Array | None) -> dict[str, Array]:
        """TRL's per-loss-type ratio metrics, over the masked tokens (token level) or the sequences (sequence
        level, ``[n, 1]`` ratios); the extremes over per-sequence means (NaN for rows without tokens)."""
        ratio = jax.lax.stop_gradient(ratio)
        m = mask.astype(jnp.float32)
        per_sequence = ratio.shape[1] == 1

        def mean(x: Array) -> Array:
            return jnp.mean(x) if per_sequence else masked_mean(x, m)

        def seq_means(x: Array) -> tuple[Array, Array]:
            if per_sequence:
                return x[:, 0], jnp.ones(x.shape[0], bool)
            return jnp.sum(x * m, axis=1) / jnp.sum(m, axis=1), jnp.sum(m, axis=1) > 0

        if self.loss_type in CLIPPED:
            low = ((ratio < 1.0 - self.epsilon_low) & (adv < 0)).astype(jnp.float32)
            high = ((ratio > 1.0 + self.resolved_epsilon_high) & (adv > 0)).astype(jnp.float32)
            low_seq, rows = seq_means(low)
            high_seq, _ = seq_means(high)
            return {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                    "clip_ratio/region_mean": mean(jnp.maximum(low, high)),
                    "clip_ratio/low_min": masked_min(low_seq, rows), "clip_ratio/high_max": masked_max(high_seq, rows)}
        if self.loss_type == "cispo":
            return {"cispo_clip_ratio": mean(((ratio > self.resolved_epsilon_high) & (adv > 0)).astype(jnp.float32))}
        if self.loss_type == "vespo":
            return {"vespo/phi_seq_mean": jnp.mean(phi)}
        return {}

