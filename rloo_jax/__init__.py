"""rloo_jax: REINFORCE Leave-One-Out (TRL's RLOOTrainer math) as pure, jittable JAX functions."""

from rloo_jax.config import RLOOConfig
from rloo_jax.errors import ConfigError, DataError, RewardError
from rloo_jax.logprobs import (
    completion_mask,
    entropy_from_logits,
    masked_mean,
    per_token_logps,
    per_token_logps_from_hidden,
)
from rloo_jax.rloo import (
    RLOOOptions,
    clipped_objective,
    combine_rewards,
    grpo_advantages,
    kl_loss,
    nanstd,
    normalize_advantages,
    rloo_advantages,
    rloo_loss,
    score_completions,
    sequence_kl,
    token_kl,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "RLOOConfig",
    "RewardError",
    "RLOOOptions",
    "clipped_objective",
    "combine_rewards",
    "completion_mask",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_loss",
    "masked_mean",
    "nanstd",
    "normalize_advantages",
    "per_token_logps",
    "per_token_logps_from_hidden",
    "rloo_advantages",
    "rloo_loss",
    "score_completions",
    "sequence_kl",
    "token_kl",
]
