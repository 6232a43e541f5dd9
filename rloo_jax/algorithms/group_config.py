"""The options RLOO and GRPO share (TRL 1.16's `RLOOConfig` and `GRPOConfig`): group sampling with a reference
in the KL (`beta`), the PPO-style clipped ratio (`epsilon`), passes over a generation batch cut into micro-batches,
where the old log-probs come from and the sampler/trainer importance-sampling correction, the reference's
synchronization (TR-DPO) and reward models scored on the decoded texts. PPO (TRL 1.12) has none of these.
"""

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rloo_jax.algorithms.common import ImportanceSampling
from rloo_jax.config import TrainConfig
from rloo_jax.errors import ConfigError
from rloo_jax.options import _at_least_one, _check, _opt

OLD = "the old TRL name of `{}` (TRL <= 0.21)"
VLLM = "TRL GRPO's name of `{}` (here between our sampler and trainer)"


@dataclass
class GroupConfig(TrainConfig):
    """`TrainConfig` and the options of group-sampling algorithms (RLOO, GRPO): completions sampled in groups of
    num_generations per prompt, advantages relative to the group, a KL to a frozen reference."""

    ALIASES: ClassVar[dict[str, tuple[str, str]]] = {
        "rloo_k": ("num_generations", OLD.format("num_generations")),
        "kl_coef": ("beta", OLD.format("beta")),
        "cliprange": ("epsilon", OLD.format("epsilon")),
        "num_ppo_epochs": ("num_iterations", OLD.format("num_iterations")),
        "vllm_importance_sampling_correction": ("importance_sampling_correction",
                                                VLLM.format("importance_sampling_correction")),
        "vllm_importance_sampling_mode": ("importance_sampling_mode", VLLM.format("importance_sampling_mode")),
        "vllm_importance_sampling_clip_min": ("importance_sampling_clip_min",
                                              VLLM.format("importance_sampling_clip_min")),
        "vllm_importance_sampling_clip_max": ("importance_sampling_clip_max",
                                              VLLM.format("importance_sampling_clip_max")),
        "vllm_importance_sampling_cap": ("importance_sampling_clip_max", VLLM.format("importance_sampling_clip_max")),
    }

    reward_model_name_or_path: list[str] | None = _opt(
        None,
        "model",
        "Reward model(s) (sequence classification with one label): local folders or hub ids, "
        "comma-separated. Scored before the functions of `reward_funcs` (as TRL's `trl rloo` script), in this "
        "order.",
    )
    steps_per_generation: int | None = _opt(
        None,
        "optimization",
        "Micro-steps per generation: one generation holds per_device_train_batch_size * "
        "steps_per_generation completions. If None, it defaults to gradient_accumulation_steps.",
    )

    # --- algorithm
    beta: float = _opt(
        0.05,
        "algorithm",
        "KL coefficient. If 0.0, the reference model is not kept, reducing memory usage and improving training speed.",
    )
    num_iterations: int = _opt(
        1,
        "algorithm",
        "Number of iterations per batch (denoted as μ in the algorithm).",
    )
    recompute_old_logps: bool | None = _opt(
        None,
        "algorithm",
        "Where the old (behaviour) log-probs come from. True: a training forward over the completions at the "
        "sampling parameters, next to the reference pass (as TRL's RLOO always does): the clipped ratio and the "
        "KL in the reward then never see the sampler/trainer rounding gap. False: the sampler's own log-probs. "
        "None: True when the run is off-policy (gradient_accumulation_steps not a multiple of "
        "steps_per_generation x num_iterations, TRL's rule) or LoRA dropout is on, else False: on-policy the "
        "update's forward itself runs at the sampling parameters (ratio exactly 1), so no extra forward is needed. "
        "Costs one no-gradient forward per generation batch when on. docs/numerics.md.",
    )
    importance_sampling_correction: bool = _opt(
        False,
        "algorithm",
        "Weight each sequence's loss by the ratio of the training forward's to the sampler's probability of it "
        "(TRL GRPO's vllm_importance_sampling_correction, here between our sampler and trainer): corrects for the "
        "rounding gap between the two paths (sampling/sampling_logp_difference). Off by default: the gap is "
        "~1e-7 in float32 and the ratio's spread in bfloat16 is noise of its own (docs/numerics.md).",
    )
    importance_sampling_mode: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"] = _opt(
        "sequence_mask",
        "algorithm",
        "How the importance-sampling ratio is bounded (TRL GRPO's modes): sequence_* use one ratio per sequence "
        "exp(sum of the token gaps), token_* one per token; *_truncate clips it to [clip_min, clip_max], *_mask "
        "sets it to 0 outside. RLOO's objective is per sequence, so token_* modes need a token-level loss "
        "(the Python API's RLOOOptions(level='token')).",
    )
    importance_sampling_clip_min: float | None = _opt(
        None,
        "algorithm",
        "Lower bound C_min of the importance-sampling ratio (None: no lower bound).",
    )
    importance_sampling_clip_max: float | None = _opt(
        3.0,
        "algorithm",
        "Upper bound C_max of the importance-sampling ratio (TRL's default 3.0; None: no upper bound).",
    )
    router_aux_loss_coef: float | None = _opt(
        None,
        "algorithm",
        "Coefficient of the load-balancing auxiliary loss for Mixture-of-Experts (MoE) models, added to the training "
        "loss with this weight. When not set, the value declared by the model config is used. Set to 0.0 to disable "
        "it. Fails when used with a non-MoE model.",
    )
    routing_replay: bool = _opt(
        True,
        "algorithm",
        "Mixture-of-experts policies: the old-log-prob, reference and update forwards route each completion and "
        "prompt token to the experts the sampler chose (gate weights from the current router), so their log-probs "
        "of the sampled tokens equal the sampler's. Not in TRL. No effect on dense policies or multi-turn rollouts. "
        "On or off, the routes are recorded and sampling/routing_mismatch logs the share of them the update's "
        "router would choose otherwise.",
    )
    epsilon: float = _opt(
        0.2,
        "algorithm",
        "Epsilon value for clipping.",
    )
    epsilon_high: float | None = _opt(
        None,
        "algorithm",
        "Upper-bound epsilon value for clipping. If not specified, it defaults to the same value as the "
        "lower-bound specified in argument epsilon. Paper DAPO recommends 0.28.",
    )
    mask_truncated_completions: bool = _opt(
        False,
        "algorithm",
        "When enabled, truncated completions are excluded from the loss calculation, preventing them from "
        "being incorrectly penalized and introducing noise during training (DAPO).",
    )
    sync_ref_model: bool = _opt(
        False,
        "algorithm",
        "Whether to synchronize the reference model with the active model every ref_model_sync_steps steps, "
        "using ref_model_mixup_alpha (TR-DPO). Needs beta > 0.",
    )
    ref_model_mixup_alpha: float = _opt(
        0.6,
        "algorithm",
        "α from TR-DPO: ref = α * policy + (1 - α) * ref_prev at each synchronization.",
    )
    ref_model_sync_steps: int = _opt(
        512,
        "algorithm",
        "τ from TR-DPO: how many optimizer steps between reference-model synchronizations.",
    )

    # --- tool calling (multi-turn rollouts: rloo_jax.turns, rloo_jax.tools, rloo_jax.conversations)
    tools: list[str] | None = _opt(
        None,
        "tools",
        "Tools the model may call (TRL's `tools`): comma-separated `module:function` names (the Python API also "
        "takes the callables), sync or async, each with type hints and a Google-style docstring (its JSON schema is "
        "what the chat template shows). A rollout is then a conversation: the model's turn ends at an EOS, its tool "
        "calls run, their results are appended to its KV cache and it goes on; the loss sees only its own tokens.",
    )
    environment_factory: str | dict | None = _opt(
        None,
        "tools",
        "TRL's `environment_factory`: `module:Class` (one environment per rollout, `reset(**row)` before it, its "
        "public methods as tools, `get_reward()` an extra reward) or a mapping {name: module:Class} picked by each "
        "row's `environment` column.",
    )
    max_tool_calling_iterations: int | None = _opt(
        None,
        "tools",
        "Tool-calling rounds per rollout (TRL's name): a completion's tool calls run at most this many times; the "
        "turn after the last round is kept as it is. None: no limit but max_completion_length.",
    )
    tool_timeout: float | None = _opt(
        30.0,
        "tools",
        "Seconds a tool call may take (sync and async alike); a call that takes longer is reported to the model "
        "as an error (`{'error': 'Tool f timed out after 30 s'}`) and counted as a failure. None: no limit.",
    )
    max_tool_calls_per_rollout: int | None = _opt(
        None,
        "tools",
        "Tool calls one rollout may make in all; later calls are reported to the model as errors and counted as "
        "failures (deterministic, so a resumed run makes the same calls). None: no limit.",
    )
    tool_workers: int = _opt(
        32,
        "tools",
        "Sync tool calls running at once, across every rollout of a generation batch (each in a thread; async "
        "ones run together on one event loop).",
    )
    tool_batch_rows: int | None = _opt(
        None,
        "tools",
        "The sampler hands paused rows (an assistant turn ended) to the host once this many are paused, while the "
        "others keep decoding; rows are then in different turns at once. None: once no row decodes (every row's "
        "turn ends before the tools run: fewest program calls). The tokens do not depend on it.",
    )
    tool_suffix_bucket: int = _opt(
        16,
        "tools",
        "A resumed turn's new tokens (tool results) are padded to tool_suffix_bucket * 2^k tokens: one compiled "
        "program per width.",
    )

    # ----------------------------------------------------------------------------------------- derived values
    @property
    def resolved_steps_per_generation(self) -> int:
        """steps_per_generation, defaulting to gradient_accumulation_steps (TRL)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def resolved_num_iterations(self) -> int:
        return self.num_iterations

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def uses_reference(self) -> bool:
        """A reference policy is kept when beta > 0."""
        return self.beta > 0

    @property
    def reference_sync(self) -> tuple[int, float] | None:
        return (self.ref_model_sync_steps, self.ref_model_mixup_alpha) if self.sync_ref_model else None

    @property
    def uses_tools(self) -> bool:
        """Rollouts are conversations: tools or environments are given."""
        return bool(self.tools) or bool(self.environment_factory)

    @property
    def reward_model_paths(self) -> list[str]:
        return list(self.reward_model_name_or_path or [])

    @property
    def reward_sources(self) -> list[str]:
        """Reward functions in scoring order: reward_model_name_or_path, then reward_funcs (TRL's script order)."""
        return self.reward_model_paths + list(self.reward_funcs or [])

    def step_options(self) -> dict[str, Any]:
        """Where the old log-probs come from and the sampler/trainer correction (`rloo_jax.step.StepConfig`)."""
        correction = None
        if self.importance_sampling_correction:
            correction = ImportanceSampling(self.importance_sampling_mode, self.importance_sampling_clip_min,
                                            self.importance_sampling_clip_max)
        return {"recompute_old_logps": self.recompute_old_logps, "importance_sampling": correction,
                "multi_turn": self.uses_tools, "router_aux_loss_coef": self.router_aux_loss_coef,
                "routing_replay": self.routing_replay}

    def report_settings(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def memory_tips(self) -> list[str]:
        return ["--beta 0 (no reference model)"] if self.beta > 0 else []

    # ----------------------------------------------------------------------------------------- validation
    def _check(self) -> None:
        _at_least_one(self, "num_iterations", "ref_model_sync_steps")
        _at_least_one(self, "steps_per_generation", optional=True)
        _check(self.beta >= 0, "beta", "must be >= 0 (0 drops the reference model)", self.beta)
        _check(self.epsilon > 0, "epsilon", "must be > 0", self.epsilon)
        _check(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high", "must be > 0 or None",
               self.epsilon_high)
        _check(0 <= self.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha", "must be in [0, 1]",
               self.ref_model_mixup_alpha)
        self._check_importance_sampling()
        self._check_tools()
        if self.use_peft and self.sync_ref_model:
            raise ConfigError(
                "sync_ref_model cannot be used with use_peft (as in TRL): the reference is the frozen base with the "
                "adapters off, or a frozen copy of the starting adapters; drop --sync_ref_model, or train without "
                "--use_peft"
            )
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError(
                "sync_ref_model needs a reference model, but beta is 0 (no reference model is "
                "kept); set --beta > 0 or --sync_ref_model false"
            )

    def _check_tools(self) -> None:
        _at_least_one(self, "max_tool_calling_iterations", "max_tool_calls_per_rollout", "tool_batch_rows",
                      optional=True)
        _at_least_one(self, "tool_workers", "tool_suffix_bucket")
        _check(self.tool_timeout is None or self.tool_timeout > 0, "tool_timeout", "must be > 0 or None",
               self.tool_timeout)
        if self.uses_tools and self.process_count > 1:
            raise ConfigError("tools and environment_factory run on one process here (the host runs every "
                              "rollout's tools); drop --num_processes or the tools")

    def _check_importance_sampling(self) -> None:
        """Old log-probs and importance-sampling options are consistent (TRL GRPO's checks, plus ours)."""
        if self.recompute_old_logps is False and not self.on_policy:
            raise ConfigError(
                "recompute_old_logps false: this run is off-policy (gradient_accumulation_steps is not a multiple "
                "of steps_per_generation x num_iterations), so its clipped ratio needs old log-probs from the training "
                "forward; drop --recompute_old_logps (None decides) or set it true"
            )
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        _check(lo is None or lo >= 0, "importance_sampling_clip_min", "must be >= 0 or None", lo)
        _check(hi is None or hi > 0, "importance_sampling_clip_max", "must be > 0 or None", hi)
        if lo is not None and hi is not None and lo >= hi:
            raise ConfigError(
                f"importance_sampling_clip_min ({lo}) must be below importance_sampling_clip_max ({hi}); fix one of "
                "them"
            )
        if not self.importance_sampling_correction:
            return
        if self.importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ConfigError(
                f"importance_sampling_mode {self.importance_sampling_mode} clips the ratio to [clip_min, clip_max]: "
                "set --importance_sampling_clip_min and/or --importance_sampling_clip_max"
            )
