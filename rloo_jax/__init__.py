"""rloo_jax: TRL's RLOO, GRPO and PPO trainers (REINFORCE Leave-One-Out, Group Relative Policy Optimization, PPO
with a value model) as pure, jittable JAX functions on one algorithm-generic step.

The public API: the trainers and their configs (TRL's constructors and names), the algorithms' pure functions, the
step and its programs, the models. How the package is laid out: docs/architecture.md."""

from rloo_jax import (
    _notices,  # noqa: F401 -- first: quiets notices of libraries imported below
    numerics,
)
from rloo_jax.backend import skip_absent_tpu

if not numerics.backend_started():
    # as the CLI: on a machine with no accelerator (JAX_PLATFORMS unset), the CPU without libtpu's start-up errors
    # (the `tpu` extra installed for compile-only), in scripts and notebooks too; JAX would fall back to it anyway
    skip_absent_tpu()
from rloo_jax.algorithms import (
    GRPO,
    PPO,
    RLOO,
    Algorithm,
    GRPOConfig,
    LossInputs,
    PPOConfig,
    RLOOConfig,
    ScoreInputs,
)
from rloo_jax.algorithms.common import (
    ImportanceSampling,
    combine_rewards,
    importance_sampling_weights,
    nanstd,
    sampling_logp_difference,
    sequence_kl,
    token_kl,
)
from rloo_jax.algorithms.grpo import (
    aggregate,
    entropy_mask,
    gamma_weights,
    group_advantages,
    grpo_advantages,
    grpo_kl,
    importance_ratio,
    off_policy_mask,
    per_token_loss,
)
from rloo_jax.algorithms.rloo import (
    RLOOOptions,
    clipped_objective,
    kl_loss,
    normalize_advantages,
    rloo_advantages,
    rloo_loss,
    score_completions,
)
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
from rloo_jax.programs import Program, Programs
from rloo_jax.sampling import Generation, SamplingConfig, generate, generate_fn
from rloo_jax.step import Rollout, Step, StepConfig, TrainState, completion_width, truncate
from rloo_jax.trainers import GRPOTrainer, PPOTrainer, RLOOTrainer

__version__ = "0.1.0"


__all__ = [
    "GRPO",
    "PPO",
    "PPOConfig",
    "PPOTrainer",
    "RLOO",
    "Algorithm",
    "GRPOConfig",
    "GRPOTrainer",
    "ImportanceSampling",
    "LossInputs",
    "Program",
    "Programs",
    "ScoreInputs",
    "Step",
    "aggregate",
    "entropy_mask",
    "gamma_weights",
    "group_advantages",
    "grpo_kl",
    "importance_ratio",
    "off_policy_mask",
    "per_token_loss",
    "CausalLM",
    "Generation",
    "ModelLoadError",
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
