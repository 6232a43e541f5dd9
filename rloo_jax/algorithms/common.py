"""What RLOO, GRPO and PPO share: NaN-aware statistics, KL estimators, reward combination, the sampler/trainer
importance-sampling correction, and the containers an algorithm's functions read.

Pure functions only (arrays in, arrays out; no config objects, no mesh). Rows of a batch are grouped contiguously:
rows ``g*G .. g*G+G-1`` are the G completions of prompt g.

Shapes: N = B*G completions (B prompts, G completions per prompt), C completion length, F reward functions, n the
rows of one micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import chex
import jax
import jax.numpy as jnp
from flax import struct

from rloo_jax.logprobs import masked_mean

Array = jax.Array
KLEstimator = Literal["k1", "k2", "k3"]
ImportanceSamplingMode = Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]

NORM_EPS = 1e-4  # TRL adds 1e-4 to a standard deviation before dividing by it


# ----------------------------------------------------------------------------------------------- statistics


def nanmean(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """Mean over the non-NaN entries (NaN when there are none), as ``torch.nanmean``."""
    valid = ~jnp.isnan(x)
    s = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=keepdims)
    return s / jnp.sum(valid, axis=axis, keepdims=keepdims)


def nanstd(x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
    """Bessel-corrected (ddof=1) standard deviation ignoring NaN, as TRL's ``nanstd``.

    ``sqrt(mean((x - mean(x))^2) * n / (n - 1))`` over the non-NaN entries; NaN (0/0) or inf for n <= 1.
    Example: ``[1, 3, nan]`` -> ``1.4142``.
    """
    valid = ~jnp.isnan(x)
    mean = nanmean(x, axis=axis, keepdims=True)
    var = nanmean(jnp.where(valid, (x - mean) ** 2, jnp.nan), axis=axis, keepdims=keepdims)
    n = jnp.sum(valid, axis=axis, keepdims=keepdims)
    return jnp.sqrt(var * n / (n - 1))


def masked_min(x: Array, valid: Array) -> Array:
    """``min`` over the entries where ``valid`` (NaN when there are none: TRL's ``nanmin`` of an empty gather)."""
    return jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, x, jnp.inf)), jnp.nan)


def masked_max(x: Array, valid: Array) -> Array:
    """``max`` over the entries where ``valid`` (NaN when there are none)."""
    return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf)), jnp.nan)


# ----------------------------------------------------------------------------------------------- KL


def token_kl(per_token_logps: Array, ref_per_token_logps: Array, estimator: KLEstimator = "k1") -> Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of pi, with ``d = logp - ref_logp``.

    - ``k1``: ``d`` (unbiased, can be negative; TRL's RLOO),
    - ``k2``: ``d^2 / 2`` (low variance, biased),
    - ``k3``: ``exp(-d) - 1 + d`` (unbiased, always >= 0; TRL's GRPO).

    Args:
      per_token_logps, ref_per_token_logps: ``[N, C]``.

    Returns:
      ``[N, C]`` float32. Example: ``d = log 2`` -> k1 0.6931, k2 0.2402, k3 0.1931.
    """
    chex.assert_equal_shape((per_token_logps, ref_per_token_logps))
    d = per_token_logps - ref_per_token_logps
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(-d) - 1.0 + d
    raise ValueError(f"kl estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def sequence_kl(
    per_token_logps: Array, ref_per_token_logps: Array, mask: Array, estimator: KLEstimator = "k1"
) -> Array:
    """Sequence KL: ``sum_t token_kl_t * mask_t`` with no length normalisation (TRL's RLOO penalty).

    Args:
      per_token_logps, ref_per_token_logps, mask: ``[N, C]``.

    Returns:
      ``[N]`` float32. Example: logps ``[[-1, -2]]``, ref ``[[-1.5, -1]]``, mask ``[[1, 1]]`` -> ``[-0.5]``.
    """
    chex.assert_equal_shape((per_token_logps, mask))
    return jnp.sum(token_kl(per_token_logps, ref_per_token_logps, estimator) * mask, axis=-1)


# ----------------------------------------------------------------------------------------------- rewards


def combine_rewards(rewards_per_func: Array, weights: Array | None = None) -> Array:
    """NaN-aware weighted sum of the reward functions: ``r_b = sum_{f: not NaN} w_f * R[b, f]``.

    A row where every function gave NaN (TRL: returned None) is unscorable and stays NaN.

    Args:
      rewards_per_func: ``[N, F]`` float, NaN for "no reward".
      weights: ``[F]``, default all ones.

    Returns:
      ``[N]`` float32. Example: ``[[1, nan], [nan, nan]]``, w ``[2, 1]`` -> ``[2, nan]``.
    """
    chex.assert_rank(rewards_per_func, 2)
    r = rewards_per_func.astype(jnp.float32)
    w = jnp.ones(r.shape[1], jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    chex.assert_shape(w, (r.shape[1],))
    nan = jnp.isnan(r)
    total = jnp.sum(jnp.where(nan, 0.0, r * w), axis=1)
    return jnp.where(jnp.all(nan, axis=1), jnp.nan, total)


def reward_metrics(rewards_per_func: Array, weights: Array | None, group_std: Array) -> dict[str, Array]:
    """TRL's reward metrics of a generation batch: ``reward`` / ``reward_std`` (NaN-aware mean and ddof-1 std of
    the weighted reward, unscorable rows left out), ``rewards/<f>/mean|std`` per function index ``f`` (renamed to
    the functions' names on the host), and ``frac_reward_zero_std``: the fraction of ``group_std`` entries (one
    per group or per row) that ``torch.isclose`` calls 0 (``|std| <= 1e-8``)."""
    raw = combine_rewards(rewards_per_func, weights)
    metrics = {}
    for f in range(rewards_per_func.shape[1]):
        col = rewards_per_func[:, f].astype(jnp.float32)
        metrics[f"rewards/{f}/mean"] = nanmean(col)
        metrics[f"rewards/{f}/std"] = nanstd(col)
    metrics["reward"] = nanmean(raw)
    metrics["reward_std"] = nanstd(raw)
    metrics["frac_reward_zero_std"] = jnp.mean((jnp.abs(group_std) <= 1e-8).astype(jnp.float32))
    return metrics


# ----------------------------------------------------------------------------------------------- sampler vs trainer


def sampling_logp_difference(train_logps: Array, sampler_logps: Array, mask: Array) -> dict[str, Array]:
    """The sampler/trainer gap (TRL GRPO's metrics): ``|train_t - sampler_t|`` over the tokens of ``mask``.

    Two code paths compute the log-prob of each sampled token: the sampler (KV-cache decode) and the training
    forward (one pass over prompt + completion). With the same parameters they differ only by rounding: ~1e-7 in
    float32, ~1e-3 in bfloat16 (docs/numerics.md).

    Args:
      train_logps, sampler_logps, mask: ``[N, C]``.

    Returns:
      ``{"sampling/sampling_logp_difference/mean": [], ".../max": []}``, both 0 for an empty mask. Example:
      train ``[[-1, -2]]``, sampler ``[[-1.5, -2]]``, mask ``[[1, 1]]`` -> mean 0.25, max 0.5.
    """
    chex.assert_equal_shape((train_logps, sampler_logps, mask))
    m = mask.astype(jnp.float32)
    delta = jnp.abs(train_logps - sampler_logps) * m
    return {
        "sampling/sampling_logp_difference/mean": jnp.sum(delta) / jnp.maximum(jnp.sum(m), 1.0),
        "sampling/sampling_logp_difference/max": jnp.max(jnp.where(m > 0, delta, 0.0)),
    }


def importance_sampling_weights(
    train_logps: Array,
    sampler_logps: Array,
    mask: Array,
    mode: ImportanceSamplingMode = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Array, dict[str, Array]]:
    """Importance-sampling correction between the sampler and the trainer (TRL GRPO's four modes and bounds).

    ``d_t = (train_t - sampler_t) * m_t`` (NaN -> 0). ``sequence_*``: one ratio per sequence
    ``rho_i = exp(sum_t d_t)``; ``token_*``: ``rho_it = exp(d_t)``. ``*_truncate``: ``clip(rho, clip_min,
    clip_max)`` (None: that side unbounded); ``*_mask``: ``rho`` where ``clip_min <= rho <= clip_max``, else 0.
    The loss of each sequence (``sequence_*``) or token (``token_*``) is multiplied by its weight; no gradient
    flows through it.

    Args:
      train_logps: ``[N, C]`` training forward at the sampling parameters; sampler_logps, mask: ``[N, C]``.

    Returns:
      ``(weights, metrics)``: weights ``[N]`` (sequence modes) or ``[N, C]`` (token modes, 1 outside the mask
      before bounding); metrics ``sampling/importance_sampling_ratio/min|mean|max`` over the sequences or the
      masked tokens (0 when there are none). Example: d = ``[[0.1, 0.2]]`` -> sequence_truncate with clip_max 1.2:
      ``[1.2]`` (exp(0.3) = 1.35 clipped); sequence_mask: ``[0.0]``; token_truncate: ``[[1.105, 1.2]]``.
    """
    chex.assert_equal_shape((train_logps, sampler_logps, mask))
    m = mask.astype(jnp.float32)
    d = jnp.nan_to_num(jax.lax.stop_gradient(train_logps - sampler_logps) * m, nan=0.0)
    sequence = mode.startswith("sequence_")
    rho = jnp.exp(jnp.sum(d, axis=1) if sequence else d)
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    if mode.endswith("_truncate"):
        rho = jnp.clip(rho, lo, hi)
    elif mode.endswith("_mask"):
        rho = jnp.where((rho >= lo) & (rho <= hi), rho, 0.0)
    else:
        raise ValueError(f"importance sampling mode must be one of {ImportanceSamplingMode.__args__}, got {mode!r}")
    counted = jnp.ones_like(rho) if sequence else m
    n = jnp.sum(counted)
    metrics = {
        "sampling/importance_sampling_ratio/min": jnp.where(n > 0, jnp.min(jnp.where(counted > 0, rho, jnp.inf)), 0.0),
        "sampling/importance_sampling_ratio/mean": jnp.sum(rho * counted) / jnp.maximum(n, 1.0),
        "sampling/importance_sampling_ratio/max": jnp.where(n > 0, jnp.max(jnp.where(counted > 0, rho, -jnp.inf)),
                                                            0.0),
    }
    return rho, metrics


# ----------------------------------------------------------------------------------------------- what the step passes


@struct.dataclass
class ScoreInputs:
    """A generation batch as an algorithm's generation-time function (``score``) reads it."""

    rewards_per_func: Array  # [N, F] float32, NaN where a function returned None
    reward_weights: Array  # [F]
    mask: Array  # [N, C] completion mask (zero rows for truncated completions with mask_truncated_completions)
    is_truncated: Array  # [N] bool: no EOS within max_completion_length
    old_logps: Array  # [N, C] behaviour-policy log-probs at the sampling parameters (0 outside the mask)
    ref_logps: Array | None  # [N, C] reference log-probs, None without a reference
    values: Array | None = None  # [N, C] value-model estimates (PPO), None otherwise
    completion_ids: Array | None = None  # [N, C] int32, the sampled tokens (pad after the mask)
    num_generations: int = struct.field(pytree_node=False, default=1)  # G


@struct.dataclass
class LossInputs:
    """One micro-batch as an algorithm's loss reads it (n rows). ``logps`` (and ``entropy``, ``values``) come from
    the update's forward with gradients; everything else is fixed for the generation batch."""

    logps: Array  # [n, C] current policy log-probs (gradients flow)
    entropy: Array  # [n, C] entropy of the current policy (gradients flow where the algorithm asks for them)
    old_logps: Array  # [n, C] behaviour policy: stop_gradient(logps) on-policy, else fixed at sampling time
    mask: Array  # [n, C] float32 completion mask
    advantages: Array  # [n] or [n, C]
    ref_logps: Array | None = None  # [n, C] reference (KL in the loss)
    sampler_logps: Array | None = None  # [n, C] the sampler's own log-probs (off-policy masks); None: old_logps
    is_weights: Array | None = None  # [n] or [n, C] sampler/trainer correction (importance_sampling_weights)
    targets: dict[str, Array] = struct.field(default_factory=dict)  # other per-row targets (PPO: returns, values)
    values: Array | None = None  # [n, C] current value estimates (PPO; gradients flow)
    num_items: Array | None = None  # [] completion tokens of the generation batch / steps_per_generation
    algo_state: Any = None  # the algorithm's state at this optimizer step (GRPO: the adaptive entropy coefficient)


def clip_fractions(
    ratio: Array, advantages: Array, mask: Array, low: float, high: float, sequence: bool
) -> dict[str, Array]:
    """TRL's ``clip_ratio/*`` metrics: low = ``ratio < low and A < 0``, high = ``ratio > high and A > 0``.

    ``sequence``: one ratio per sequence (``ratio`` ``[n]``, ``advantages`` ``[n]``), means over sequences; else
    per token (``ratio`` ``[n, C]``, ``advantages`` ``[n]`` or ``[n, C]``), means over the masked tokens. The
    extremes (``low_min``, ``high_max``) are taken over the per-sequence means (NaN-free rows only).
    """
    a = advantages if sequence or advantages.ndim == 2 else advantages[:, None]
    lo = ((ratio < low) & (a < 0)).astype(jnp.float32)
    hi = ((ratio > high) & (a > 0)).astype(jnp.float32)
    region = jnp.maximum(lo, hi)
    if sequence:
        return {"clip_ratio/low_mean": jnp.mean(lo), "clip_ratio/low_min": jnp.min(lo),
                "clip_ratio/high_mean": jnp.mean(hi), "clip_ratio/high_max": jnp.max(hi),
                "clip_ratio/region_mean": jnp.mean(region)}
    m = mask.astype(jnp.float32)
    rows = jnp.sum(m, axis=1) > 0
    per_seq = lambda x: jnp.sum(x * m, axis=1) / jnp.sum(m, axis=1)  # noqa: E731 - NaN for empty rows, as TRL
    return {"clip_ratio/low_mean": masked_mean(lo, m), "clip_ratio/low_min": masked_min(per_seq(lo), rows),
            "clip_ratio/high_mean": masked_mean(hi, m), "clip_ratio/high_max": masked_max(per_seq(hi), rows),
            "clip_ratio/region_mean": masked_mean(region, m)}


@dataclasses.dataclass(frozen=True)
class ImportanceSampling:
    """The sampler/trainer importance-sampling correction (TRL GRPO's ``vllm_importance_sampling_*``; here between
    our sampler and the training forward): ``algorithms.common.importance_sampling_weights``."""

    mode: ImportanceSamplingMode = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0
