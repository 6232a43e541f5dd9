"""GRPO's configuration: TRL 1.16's `GRPOConfig` names and defaults (group-relative advantages, the KL as a k3 term
of the loss, eight loss types; beta 0 and 8 generations by default), its TRL option table and its demo run. The math
is `rloo_jax.algorithms.grpo`."""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rloo_jax import demo
from rloo_jax.algorithms.group_config import GroupConfig
from rloo_jax.algorithms.grpo import GRPO
from rloo_jax.config import takes_trl_options
from rloo_jax.errors import ConfigError
from rloo_jax.options import _check, _opt
from rloo_jax.trl_options import Decision, accepted, is_none, off, refused, supported, table

logger = logging.getLogger("rloo_jax")

_SCALE_REWARDS = {"true": "group", "false": "none"}  # TRL's GRPOConfig maps the booleans


def _vllm_correction(v: Any) -> dict[str, Any]:
    """On (with use_vllm, which `split_options` has folded in: TRL corrects only vLLM's samples) turns our
    correction on; off leaves ours as it is."""
    return {} if off(v) else {"importance_sampling_correction": True}


OWN: list[tuple[str, str, Decision]] = [
    ("GRPO algorithm", "loss_type scale_rewards multi_objective_aggregation delta importance_sampling_level "
     "sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg "
     "top_entropy_quantile entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta "
     "entropy_target off_policy_mask_threshold use_bias_correction_kl",
     supported("TRL 1.16's math, every loss_type (docs/research_api.md); use_adaptive_entropy's state is "
               "checkpointed")),
    ("use_vllm", "use_vllm", accepted(
        "generation always runs on the JAX sampler, an inference path of its own as vLLM is; use_vllm true makes "
        "TRL's vllm_importance_sampling_correction apply to it, as TRL applies it to vLLM's samples",
        takes_text="true, false")),
    ("vllm_importance_sampling_correction", "vllm_importance_sampling_correction", accepted(
        "importance_sampling_correction here, between our sampler and the trainer: on only with use_vllm true, as "
        "in TRL (whose default is true with use_vllm false: off)", takes_text="true (with use_vllm true), false",
        translate=_vllm_correction)),
    ("vllm_importance_sampling_mode", "vllm_importance_sampling_mode",
     accepted("our importance_sampling_mode", takes_text="its four modes",
              translate=lambda v: {"importance_sampling_mode": v})),
    ("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_min",
     accepted("our importance_sampling_clip_min", takes_text="a number or None",
              translate=lambda v: {"importance_sampling_clip_min": v})),
    ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_max vllm_importance_sampling_cap",
     accepted("our importance_sampling_clip_max (vllm_importance_sampling_cap: TRL's deprecated name)",
              takes_text="a number or None", translate=lambda v: {} if is_none(v) else
              {"importance_sampling_clip_max": v})),
    ("cast_lm_head_to_fp32", "cast_lm_head_to_fp32", accepted(
        "the head's logits are taken in float32 and the log-softmax is float32 whatever the compute dtype")),
    ("max_tool_calling_iterations", "max_tool_calling_iterations",
     supported("tool-calling rounds per rollout (GRPOTrainer's tools / environment_factory: multi-turn rollouts "
               "on the KV-cache sampler)")),
    ("log_completions_hub_repo", "log_completions_hub_repo", refused(
        "nothing is uploaded: rollouts.jsonl in output_dir holds every recorded completion", is_none, "None")),
]


@takes_trl_options
@dataclass
class GRPOConfig(GroupConfig):
    """Everything one GRPO run needs: `TrainConfig`, the group options GRPO shares with RLOO and GRPO's own, with
    TRL 1.16's `GRPOConfig` names and defaults (group-relative advantages, the KL as a k3 term of the loss, eight
    loss types; beta 0 and 8 generations by default)."""

    ALGORITHM: ClassVar[str] = "grpo"
    TRL_OPTIONS: ClassVar[dict[str, Decision]] = table(OWN)
    """TRL 1.16's GRPO options (`trl.GRPOConfig`, the `trl grpo` script's)."""
    TRL_SOURCES: ClassVar[tuple[str, ...]] = ("trl.GRPOConfig", "trl.ModelConfig",
                                              "trl.scripts.grpo.GRPOScriptArguments", "trl.DatasetMixtureConfig")
    DEMO: ClassVar[dict[str, Any]] = {**demo.DEFAULT_CONFIG, "output_dir": "outputs/demo-grpo"}

    num_generations: int = _opt(
        8,
        "generation",
        "Number of generations to sample per prompt (G). The generation batch (per_device_train_batch_size "
        "* steps_per_generation) must be evenly divisible by this value.",
    )
    beta: float = _opt(
        0.0,
        "algorithm",
        "KL coefficient of the k3 KL term in the loss. If 0.0 (default), the reference model is not loaded, reducing "
        "memory usage and improving training speed. DeepSeek-R1 uses 0.001.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = _opt(
        "dapo",
        "grpo",
        "The loss: grpo (token mean per sequence, then mean), dr_grpo (token sum / (sequences * "
        "max_completion_length)), dapo (token sum / the generation batch's tokens per step: no length bias), bnpo "
        "(token mean over the micro-batch), cispo (clipped importance weights times advantage times log-prob, "
        "MiniMax-M1), sapo (a soft sigmoid gate instead of clipping), luspo (per-sequence token sums: sequence "
        "level, GSPO-style), vespo (Gamma-weighted sequence ratios). docs/research_api.md has each formula.",
    )
    scale_rewards: Literal["group", "batch", "none"] = _opt(
        "group",
        "grpo",
        "Advantages divided by the std of the group's rewards (group; TRL's True), of the whole batch's (batch), or "
        "not at all (none; TRL's False, as Dr. GRPO recommends).",
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = _opt(
        "sum_then_normalize",
        "grpo",
        "Several reward functions: weighted sum, then scale_rewards (sum_then_normalize), or each normalised within "
        "its group, then summed and normalised over the batch (normalize_then_sum, GDPO).",
    )
    delta: float | None = _opt(
        None,
        "grpo",
        "Two-sided clipping (INTELLECT-2): the ratio of the unclipped term is capped at delta (> 1 + epsilon).",
    )
    importance_sampling_level: Literal["token", "sequence"] = _opt(
        "token",
        "grpo",
        "The importance ratio per token, or per sequence as the exp of the masked mean of the token log-ratios "
        "(GSPO).",
    )
    sapo_temperature_neg: float = _opt(1.05, "grpo", "sapo's gate temperature where the advantage is <= 0.")
    sapo_temperature_pos: float = _opt(1.0, "grpo", "sapo's gate temperature where the advantage is > 0.")
    vespo_k_pos: float = _opt(2.0, "grpo", "vespo's power k where the advantage is >= 0.")
    vespo_lambda_pos: float = _opt(3.0, "grpo", "vespo's decay lambda where the advantage is >= 0.")
    vespo_k_neg: float = _opt(3.0, "grpo", "vespo's power k where the advantage is < 0.")
    vespo_lambda_neg: float = _opt(2.0, "grpo", "vespo's decay lambda where the advantage is < 0.")
    top_entropy_quantile: float = _opt(
        1.0,
        "grpo",
        "Keep in the policy loss only the top rho quantile of the micro-batch's tokens by entropy (Beyond the 80/20 "
        "rule: 0.2); 1.0 keeps all.",
    )
    entropy_coef: float = _opt(
        0.0,
        "grpo",
        "Coefficient of the entropy bonus (loss - coef * mean token entropy); with use_adaptive_entropy, its start "
        "value.",
    )
    use_adaptive_entropy: bool = _opt(
        False,
        "grpo",
        "Skywork-OR1's adaptive control: after each optimizer step entropy_coef moves by entropy_coef_delta (up when "
        "the step's mean entropy <= entropy_target, else down), and the bonus applies only while the last step's "
        "entropy was <= entropy_target. Its state is checkpointed.",
    )
    entropy_coef_min: float = _opt(0.0, "grpo", "Lower bound of the adaptive entropy coefficient.")
    entropy_coef_max: float = _opt(1.0, "grpo", "Upper bound of the adaptive entropy coefficient.")
    entropy_coef_delta: float = _opt(0.005, "grpo", "Step of the adaptive entropy coefficient.")
    entropy_target: float = _opt(0.2, "grpo", "Target mean token entropy (nats) of the adaptive control.")
    off_policy_mask_threshold: float | None = _opt(
        None,
        "grpo",
        "DeepSeek-V3.2's off-policy sequence mask: drop sequences with a negative advantage whose mean token KL from "
        "the sampling policy exceeds this (e.g. 0.5). None: off.",
    )
    use_bias_correction_kl: bool = _opt(
        True,
        "grpo",
        "Multiply the KL term by the (differentiable) importance ratio: the unbiased reverse-KL gradient "
        "(DeepSeek-V3.2). Changes the KL gradient whenever beta != 0.",
    )

    def validate(self) -> None:
        raw = self.scale_rewards
        if isinstance(raw, bool) or str(raw).strip().lower() in _SCALE_REWARDS:
            self.scale_rewards = _SCALE_REWARDS[str(raw).strip().lower()]
        super().validate()

    def _check(self) -> None:
        _check(0.0 <= self.top_entropy_quantile <= 1.0, "top_entropy_quantile", "must be in [0, 1]",
               self.top_entropy_quantile)
        _check(self.delta is None or self.delta > 0, "delta", "must be > 0 or None", self.delta)
        _check(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
               "off_policy_mask_threshold", "must be >= 0 or None", self.off_policy_mask_threshold)
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            _check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        _check(self.entropy_coef_min <= self.entropy_coef_max, "entropy_coef_min", "must be <= entropy_coef_max",
               self.entropy_coef_min)
        _check(self.entropy_coef_delta >= 0, "entropy_coef_delta", "must be >= 0", self.entropy_coef_delta)
        if (self.loss_type == "vespo" and self.importance_sampling_correction
                and not self.importance_sampling_mode.startswith("token_")):
            raise ConfigError(
                f"loss_type vespo folds the sampler/trainer weights into its token-level Gamma weights (TRL): "
                f"importance_sampling_mode must be token_truncate or token_mask (got {self.importance_sampling_mode})"
            )
        notes = {
            ("luspo", "token"): "luspo is meant for importance_sampling_level sequence (the LUSPO paper's setup)",
            ("vespo", "sequence"): "vespo computes sequence weights itself: importance_sampling_level should be token",
        }
        note = notes.get((self.loss_type, self.importance_sampling_level))
        if note is None and self.importance_sampling_level == "sequence" and self.loss_type in (
                "bnpo", "dr_grpo", "dapo", "cispo"):
            note = (f"with importance_sampling_level sequence, {self.loss_type} sums per-token terms (each sequence "
                    "weighted by its length); GSPO's setup is loss_type grpo")
        if note:
            logger.warning("note: %s (as TRL warns)", note)

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        names = [f.name for f in dataclasses.fields(GRPO) if f.name != "max_completion_length"]
        return GRPO(**{name: getattr(self, name) for name in names},
                    max_completion_length=self.max_completion_length)

    def report_settings(self) -> dict[str, Any]:
        return {**super().report_settings(), "loss_type": self.loss_type}
