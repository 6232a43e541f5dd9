"""RLOO's configuration: TRL 1.16's `RLOOConfig` names and defaults (KL in the reward, the leave-one-out baseline, a
sequence-level clipped objective), its TRL option table and its demo run. The math is `rloo_jax.algorithms.rloo`."""

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rloo_jax import demo
from rloo_jax.algorithms.group_config import GroupConfig
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.config import takes_trl_options
from rloo_jax.errors import ConfigError
from rloo_jax.options import _opt
from rloo_jax.trl_options import _GENERATION_ENGINE, Decision, off, refused, supported, table

OWN: list[tuple[str, str, Decision]] = [
    ("RLOO algorithm", "normalize_advantages reward_clip_range", supported("TRL 1.16's math (docs/research_api.md)")),
    ("use_vllm", "use_vllm", refused(_GENERATION_ENGINE, off, "false")),
]


@takes_trl_options
@dataclass
class RLOOConfig(GroupConfig):
    """Everything one RLOO run needs: `TrainConfig`, the group options RLOO shares with GRPO and RLOO's own, with
    TRL 1.16's `RLOOConfig` names and defaults (KL in the reward, leave-one-out baseline, sequence-level clipped
    objective)."""

    ALGORITHM: ClassVar[str] = "rloo"
    TRL_OPTIONS: ClassVar[dict[str, Decision]] = table(OWN)
    """TRL 1.16's RLOO options (`trl.RLOOConfig`, the `trl rloo` script's)."""
    TRL_SOURCES: ClassVar[tuple[str, ...]] = ("trl.RLOOConfig", "trl.ModelConfig",
                                              "trl.scripts.rloo.RLOOScriptArguments", "trl.DatasetMixtureConfig")
    DEMO: ClassVar[dict[str, Any]] = demo.DEFAULT_CONFIG

    missing_eos_penalty: float | None = _opt(
        None,
        "rewards",
        "Subtract this from the reward of completions that did not end with EOS (older TRL option).",
    )
    reward_clip_range: tuple[float, float] | None = _opt(
        None,
        "rewards",
        "Clip range for rewards as (min, max), e.g. `-1,1`. If None, no clipping is applied.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _opt(
        "k1",
        "algorithm",
        "KL estimator for the penalty: k1 (TRL: old_logp - ref_logp), k2 or k3.",
    )
    token_level_kl: bool = _opt(
        False,
        "algorithm",
        "Spread the KL penalty per token instead of subtracting the sequence KL from the reward (older TRL).",
    )
    normalize_advantages: bool = _opt(
        False,
        "algorithm",
        "Whether to normalize advantages. Normalization is done per generation batch to have mean 0.0 and "
        "standard deviation of 1.0.",
    )

    def _check(self) -> None:
        if self.reward_clip_range is not None and not self.reward_clip_range[0] < self.reward_clip_range[1]:
            raise ConfigError(f"reward_clip_range must be (min, max) with min < max (got {self.reward_clip_range})")
        if self.importance_sampling_correction and self.importance_sampling_mode.startswith("token_"):
            raise ConfigError(
                f"importance_sampling_mode {self.importance_sampling_mode} weights each token's loss, but RLOO's loss "
                "is per sequence (TRL's RLOO): use sequence_mask or sequence_truncate (token modes need a token-level "
                "loss: GRPO, or the Python API's RLOO(level='token'))"
            )

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        return RLOO(
            beta=self.beta, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            normalize_advantages=self.normalize_advantages, reward_clip_range=self.reward_clip_range,
            mask_truncated_completions=self.mask_truncated_completions, missing_eos_penalty=self.missing_eos_penalty,
            kl_estimator=self.kl_estimator, token_level_kl=self.token_level_kl,
        )
