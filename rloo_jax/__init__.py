"""rloo_jax: REINFORCE Leave-One-Out (TRL's RLOOTrainer math) as pure, jittable JAX functions."""

from rloo_jax import (
    _notices,  # noqa: F401 -- first: quiets notices of libraries imported below
    numerics,
)
from rloo_jax.config import RLOOConfig
from rloo_jax.errors import ConfigError, DataError, RewardError
from rloo_jax.logprobs import (
    completion_mask,
    entropy_from_logits,
    masked_mean,
    per_token_logps,
    per_token_logps_from_hidden,
)
from rloo_jax.models import (
    CausalLM,
    ModelLoadError,
    RewardModel,
    init_causal_lm,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    save_pretrained,
)
from rloo_jax.rloo import (
    RLOOOptions,
    clipped_objective,
    combine_rewards,
    grpo_advantages,
    importance_sampling_weights,
    kl_loss,
    nanstd,
    normalize_advantages,
    rloo_advantages,
    rloo_loss,
    sampling_logp_difference,
    score_completions,
    sequence_kl,
    token_kl,
)
from rloo_jax.sampling import Generation, SamplingConfig, generate, generate_fn
from rloo_jax.step import RLOOStep, Rollout, StepConfig, TrainState, completion_width, truncate

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`rloo_jax.RLOOTrainer`, imported on first use: it imports the training loop (`rloo_jax.train`), which
    `python -m rloo_jax.train` must find not yet imported."""
    if name == "RLOOTrainer":
        from rloo_jax.trainer import RLOOTrainer

        return RLOOTrainer
    raise AttributeError(f"module 'rloo_jax' has no attribute {name!r}")


__all__ = [
    "CausalLM",
    "Generation",
    "ModelLoadError",
    "RLOOStep",
    "RLOOTrainer",
    "RewardModel",
    "Rollout",
    "SamplingConfig",
    "StepConfig",
    "TrainState",
    "completion_width",
    "truncate",
    "generate",
    "generate_fn",
    "init_causal_lm",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "save_pretrained",
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
    "importance_sampling_weights",
    "kl_loss",
    "masked_mean",
    "nanstd",
    "normalize_advantages",
    "per_token_logps",
    "per_token_logps_from_hidden",
    "rloo_advantages",
    "rloo_loss",
    "sampling_logp_difference",
    "score_completions",
    "sequence_kl",
    "token_kl",
    "numerics",
]
