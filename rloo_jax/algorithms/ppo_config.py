"""PPO's configuration: TRL 1.12's `PPOConfig` names and defaults (`trl.experimental.ppo`: a value model, GAE, the
clipped policy and value losses, PPO epochs over shuffled mini-batches), its TRL option table and its demo run. The
math is `rloo_jax.algorithms.ppo`; docs/ppo.md."""

import fractions
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rloo_jax import demo
from rloo_jax.algorithms.ppo import PPO, TEMPERATURE_EPS
from rloo_jax.config import TrainConfig, takes_trl_options
from rloo_jax.errors import ConfigError
from rloo_jax.options import _check, _opt, _require
from rloo_jax.trl_options import _VLLM, Decision, accepted, is_none, off, refused, supported, table

logger = logging.getLogger("rloo_jax")


def _max_grad_norm_unused(v: Any) -> dict[str, Any]:
    if not off(v) and float(v) != 0.0:
        logger.warning("note: max_grad_norm=%s has no effect: TRL 1.12's PPOTrainer never clips gradients", v)
    return {}


OWN: list[tuple[str, str, Decision]] = [
    ("PPO algorithm", "kl_coef kl_estimator cliprange vf_coef cliprange_value gamma lam whiten_rewards num_ppo_epochs "
     "num_mini_batches missing_eos_penalty stop_token stop_token_id total_episodes",
     supported("TRL 1.12's math (docs/ppo.md); num_mini_batches must divide gradient_accumulation_steps or be a "
               "multiple of it")),
    ("temperature", "temperature", supported("sampling; every log-prob at temperature + 1e-7, as TRL")),
    ("model paths", "sft_model_path reward_model_path", supported(
        "the policy (default: model_name_or_path, which then names the tokenizer, as TRL's scripts) and the reward "
        "model, scored on the token ids on the device; the value model is value_model_path (default: the reward "
        "model)")),
    ("response_length", "response_length", accepted(
        "TRL 1.12's name of max_completion_length, the field here", takes_text="a length >= 1 (max_completion_length)",
        translate=lambda v: {"max_completion_length": v})),
    ("local_rollout_forward_batch_size", "local_rollout_forward_batch_size", accepted(
        "the rollout's no-gradient forwards (old and reference log-probs, values, the reward) run in the update's "
        "micro-batches; TRL's chunking of them changes no number")),
    ("num_sample_generations", "num_sample_generations", accepted(
        "sample completions are recorded with log_completions; evaluation runs every eval_steps")),
    ("derived batch sizes", "world_size num_total_batches micro_batch_size local_batch_size batch_size "
     "local_mini_batch_size mini_batch_size",
     accepted("sizes TRL 1.12 computes and writes into its config (its dumps hold them): computed the same way here")),
    ("adapter names", "model_adapter_name ref_adapter_name", refused(
        "one LoRA adapter on the policy (use_peft); the reference is the base with it off", is_none, "None")),
    ("dataset_num_proc", "dataset_num_proc", accepted("prompts are tokenized in the loop, one batch at a time")),
    ("max_grad_norm", "max_grad_norm", accepted(
        "TRL 1.12's PPOTrainer never clips gradients (its max_grad_norm is read by nothing): neither does this",
        takes_text="any value (no clipping, as TRL 1.12's PPO)", translate=_max_grad_norm_unused)),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", supported(
        "micro-batches per optimizer step, inside one PPO update (see num_mini_batches)")),
    ("logging_steps", "logging_steps", supported(
        "counted in PPO updates (default 1 here: TRL 1.12's PPO logs every update, whatever logging_steps)")),
]


# options of the shared table that TRL 1.12's PPOConfig, ModelConfig and ScriptArguments do not have (RLOO / GRPO's)
NOT_IN_TRL = set(
    "beta cache_implementation chat_template_kwargs datasets disable_dropout epsilon epsilon_high "
    "generation_batch_size generation_kwargs log_completions log_multimodal log_unique_prompts "
    "mask_truncated_completions max_completion_length min_p model_init_kwargs num_completions_to_print "
    "num_generations num_generations_eval num_iterations pad_to_multiple_of ref_model_mixup_alpha "
    "ref_model_sync_steps repetition_penalty reward_funcs reward_model_name_or_path reward_weights "
    "router_aux_loss_coef shuffle_dataset steps_per_generation streaming sync_ref_model test_split_size top_k "
    "top_p transformers_continuous_batching_config trust_remote_code use_transformers_continuous_batching "
    "use_transformers_paged ".split()
    + _VLLM.split()
)

# the options of RLOO / GRPO that PPO has no use for: (the value that asks for nothing, what PPO has instead); that
# value is dropped, as a config.yaml of a PPO run from before these left the shared base holds it
NOT_OPTIONS: dict[str, tuple[Any, str]] = {
    "beta": (0.05, "PPO's KL coefficient is kl_coef"),
    "epsilon": (0.2, "PPO's clip range is cliprange"),
    "epsilon_high": (None, "PPO clips symmetrically with cliprange (cliprange_value for the value model)"),
    "num_iterations": (1, "PPO's passes over a batch are num_ppo_epochs"),
    "steps_per_generation": (None, "PPO's micro-batches follow from gradient_accumulation_steps and num_mini_batches"),
    "mask_truncated_completions": (False, "PPO has missing_eos_penalty for completions without EOS"),
    "importance_sampling_correction": (False, "PPO's rollout log-probs are always a training forward's (TRL 1.12)"),
    "importance_sampling_mode": ("sequence_mask", "PPO has no importance-sampling correction"),
    "importance_sampling_clip_min": (None, "PPO has no importance-sampling correction"),
    "importance_sampling_clip_max": (3.0, "PPO has no importance-sampling correction"),
    "recompute_old_logps": (True, "PPO always recomputes the rollout log-probs with a training forward"),
    "sync_ref_model": (False, "PPO's reference stays the initial policy (TRL 1.12)"),
    "ref_model_mixup_alpha": (0.6, "PPO's reference stays the initial policy (TRL 1.12)"),
    "ref_model_sync_steps": (512, "PPO's reference stays the initial policy (TRL 1.12)"),
    "reward_model_name_or_path": (None, "PPO's reward model is reward_model_path: it scores the token ids on the "
                                        "device, as TRL's PPOTrainer does (the policy's tokenizer)"),
}

# PPO on the demo prompts: one completion per prompt, a value model (the demo policy's backbone with a new score
# head), the dense letters reward as the score (the echo task's reward is ~0 for most single random completions: PPO
# measured 0.004 -> 0.04 in 70 updates on it), 12-token completions; generation stops at EOS (TRL's stop_token). A
# step is one PPO update.
DEMO: dict[str, Any] = {
    **{k: v for k, v in demo.DEFAULT_CONFIG.items() if k not in ("num_generations", "beta", "max_grad_norm",
                                                                  "num_generations_eval")},
    "output_dir": "outputs/demo-ppo",
    "reward_funcs": ["rloo_jax.demo:letters_reward"],
    "max_completion_length": 12,
    "value_model_path": "demo",
    "stop_token": "eos",
    "kl_coef": 0.02,
    "num_ppo_epochs": 2,
    "num_mini_batches": 1,
    "per_device_train_batch_size": 64,
}


@takes_trl_options
@dataclass
class PPOConfig(TrainConfig):
    """Everything one PPO run needs: `TrainConfig` and PPO's own fields, with TRL 1.12's `PPOConfig` names and
    defaults (`trl.experimental.ppo`: a value model, GAE, the clipped policy and value losses, PPO epochs over
    shuffled mini-batches). A step is one PPO update (a generation batch), as TRL counts them; `response_length`
    is TRL's name of `max_completion_length`. TRL's sampler options are temperature only; the sampler's others
    (top_k, top_p, min_p, repetition_penalty) work here as for the other trainers. docs/ppo.md."""

    ALGORITHM: ClassVar[str] = "ppo"
    TRL_RELEASE: ClassVar[str] = "1.12"  # the last release with PPOTrainer
    TRL_OPTIONS: ClassVar[dict[str, Decision]] = table(OWN, exclude=NOT_IN_TRL)
    """TRL 1.12's PPO options (`trl.experimental.ppo.PPOConfig`, the ppo_tldr.py script's `ModelConfig` and
    `ScriptArguments`; vendored in tests/ppo_trl112_fields.py)."""
    TRL_SOURCES: ClassVar[tuple[str, ...]] = ("trl.experimental.ppo.PPOConfig (1.12)", "trl.ModelConfig (1.12)",
                                              "trl.ScriptArguments (1.12)")
    NOT_OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = NOT_OPTIONS
    MIN_GENERATIONS: ClassVar[int] = 1
    STEPS_SPAN_GENERATIONS: ClassVar[bool] = False  # its optimizer steps stay inside a PPO update
    DEMO: ClassVar[dict[str, Any]] = DEMO

    learning_rate: float = _opt(3e-6, "optimization", "The initial learning rate for AdamW (TRL 1.12 PPO's default).")
    temperature: float = _opt(
        0.7,
        "generation",
        "Sampling temperature; log-probs are taken at temperature + 1e-7, as TRL 1.12's PPOTrainer does (0: greedy "
        "sampling, log-probs at 1 + 1e-7).",
    )
    max_completion_length: int = _opt(
        53,
        "generation",
        "Tokens generated per completion (TRL 1.12's response_length: either name works). Generation stops early "
        "only at stop_token / stop_token_id.",
    )
    num_generations: int = _opt(1, "generation", "PPO samples one completion per prompt (fixed at 1).")
    logging_steps: int | float = _opt(
        1,
        "logging",
        "Log metrics every this many PPO updates (TRL 1.12's PPO logs every update, whatever its logging_steps: "
        "default 1 here); a float in (0, 1) is a ratio of the run's updates (rounded up, as transformers).",
    )
    max_grad_norm: float = _opt(0.0, "optimization", "TRL 1.12's PPOTrainer never clips gradients (fixed at 0).")
    missing_eos_penalty: float | None = _opt(
        None,
        "rewards",
        "Subtracted from the score of completions whose (stop-token-cut) response holds no EOS token.",
    )
    reward_model_path: str | None = _opt(
        None,
        "model",
        "The reward model (a *ForSequenceClassification checkpoint with one label, sharing the policy's tokenizer): "
        "it scores the token ids of prompt + completion (cut after the stop token) at its last token, on the "
        "device, as TRL's PPOTrainer does. Scored first; reward_funcs (Python functions) may add to it, weighted "
        "by reward_weights.",
    )
    value_model_path: str | None = _opt(
        None,
        "model",
        "The value model: a *ForSequenceClassification checkpoint (one label), or a causal LM's folder (its "
        "backbone with a new score head, as AutoModelForSequenceClassification.from_pretrained loads it); the "
        "same tokenizer as the policy. None: reward_model_path (TRL's scripts start the value model from the "
        "reward model). Trained with the policy by one AdamW; exported to <output_dir>/final_value.",
    )
    sft_model_path: str | None = _opt(
        None,
        "model",
        "The policy (and reference) checkpoint, as TRL's PPO scripts read it; None: model_name_or_path. When both "
        "are set, the tokenizer is model_name_or_path's (TRL's scripts).",
    )
    pad_token: str | None = _opt(
        None,
        "model",
        "A pad token added to the tokenizer when it has none (TRL's TL;DR script adds `[PAD]`); its id must be "
        "inside the models' vocabulary. PPO needs a pad distinct from EOS: TRL's masks treat every pad id as "
        "padding.",
    )
    stop_token: Literal["eos"] | None = _opt(
        None,
        "ppo",
        "`eos`: generation stops at the tokenizer's EOS and the response is cut after it. None: stop_token_id.",
    )
    stop_token_id: int | None = _opt(
        None,
        "ppo",
        "Generation stops at this token and the response is cut after it. None (with stop_token None): every "
        "completion is max_completion_length tokens, EOS or not (TRL).",
    )
    kl_coef: float = _opt(0.05, "ppo", "KL coefficient: the per-token reward is -kl_coef * KL, plus the score.")
    kl_estimator: Literal["k1", "k3"] = _opt(
        "k1",
        "ppo",
        "Per-token KL estimator of the reward penalty: k1 (logp - ref_logp) or k3 ((r - 1) - log r, r = "
        "ref / p; lower variance).",
    )
    cliprange: float = _opt(0.2, "ppo", "Clip range of the policy ratio.")
    vf_coef: float = _opt(0.1, "ppo", "Coefficient of the value loss in the total loss.")
    cliprange_value: float = _opt(0.2, "ppo", "Clip range of the value prediction around the rollout's value.")
    gamma: float = _opt(1.0, "ppo", "Discount factor of GAE.")
    lam: float = _opt(0.95, "ppo", "Lambda of GAE.")
    whiten_rewards: bool = _opt(
        False, "ppo", "Whiten the per-token rewards (mean kept) before GAE (needs 8+ rows per mini-batch, as TRL)."
    )
    num_ppo_epochs: int = _opt(4, "ppo", "Passes over each generation batch (a new shuffle each).")
    num_mini_batches: int = _opt(
        1,
        "ppo",
        "Mini-batches per PPO epoch; must divide gradient_accumulation_steps or be a multiple of it. The optimizer "
        "steps every gradient_accumulation_steps micro-batches, across mini-batch boundaries, as in TRL.",
    )
    total_episodes: int | None = _opt(
        None,
        "ppo",
        "Completions to train on: ceil(total_episodes / batch) PPO updates. None: num_train_epochs x the number of "
        "prompts. max_steps (updates), when set, wins.",
    )

    def validate(self) -> None:
        if isinstance(self.max_completion_length, int) and self.max_completion_length < 1:
            raise ConfigError(
                f"response_length (max_completion_length) must be >= 1 (got {self.max_completion_length}): PPO "
                "scores and trains on generated tokens; set --response_length 1 or more"
            )
        super().validate()

    @property
    def response_length(self) -> int:
        """TRL 1.12's name of max_completion_length."""
        return self.max_completion_length

    @property
    def local_mini_batch_size(self) -> int:
        """Rows per mini-batch on one data shard: per_device_train_batch_size x gradient_accumulation_steps /
        num_mini_batches (TRL's)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.num_mini_batches

    @property
    def micro_batch_rows(self) -> int:
        """Rows of one forward/backward per data shard: per_device_train_batch_size, or a whole mini-batch when it
        is smaller (TRL)."""
        return min(self.per_device_train_batch_size, self.local_mini_batch_size)

    @property
    def resolved_steps_per_generation(self) -> int:
        """Micro-batches per PPO epoch: per_device_train_batch_size x gradient_accumulation_steps / their rows."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.micro_batch_rows

    @property
    def generation_batch_size(self) -> int:
        """Completions per PPO update (TRL's batch_size): per_device_train_batch_size x gradient_accumulation_steps
        x data shards."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.data_shards

    @property
    def resolved_num_iterations(self) -> int:
        return self.num_ppo_epochs

    @property
    def uses_reference(self) -> bool:
        return True

    @property
    def reference_copies_given_adapters(self) -> bool:
        return False

    @property
    def policy_path(self) -> str | None:
        return self.sft_model_path or self.model_name_or_path

    @property
    def tokenizer_path(self) -> str | None:
        return self.model_name_or_path or self.sft_model_path

    @property
    def resolved_value_model_path(self) -> str | None:
        return self.value_model_path or self.reward_model_path

    @property
    def reward_sources(self) -> list[str]:
        """The reward model (scored on the device, first), then reward_funcs."""
        return self.device_reward_paths + list(self.reward_funcs or [])

    @property
    def device_reward_paths(self) -> list[str]:
        return [self.reward_model_path] if self.reward_model_path else []

    @property
    def uses_value_model(self) -> bool:
        return True

    def prepare_tokenizer(self, tokenizer: Any) -> None:
        """TRL's scripts' pad token (`pad_token`), then PPO's needs: a pad distinct from EOS (TRL's masks treat
        every pad id as padding, an EOS too when they are one) and the stop token in the vocabulary."""
        if self.pad_token is not None and tokenizer.pad_token != self.pad_token:
            tokenizer.add_special_tokens({"pad_token": self.pad_token})
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no eos_token: PPO's missing_eos_penalty and stop_token need one")
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ConfigError(
                f"the tokenizer's pad token is its EOS ({tokenizer.eos_token!r}): PPO masks every pad id as padding "
                "(TRL), which would cut every EOS out of the responses; set --pad_token '[PAD]' as TRL's PPO scripts "
                "do (a token inside the model's vocabulary)"
            )
        stop = self.resolved_stop_token_id(tokenizer)
        if stop is not None and not 0 <= stop < len(tokenizer):
            raise ConfigError(f"stop_token_id {stop} is not a token of the tokenizer ({len(tokenizer)} tokens)")

    @property
    def steps_per_generation_batch(self) -> int:
        return 1  # TRL 1.12's PPO counts updates (its global_step), whatever the optimizer steps in one

    def total_steps(self, num_prompts: int) -> int:
        """max_steps (updates), else TRL's num_total_batches: ceil(total_episodes / batch), total_episodes
        defaulting to num_train_epochs x the prompts."""
        if self.max_steps > 0:
            return self.max_steps
        episodes = self.total_episodes or int(self.num_train_epochs * num_prompts)
        return max(1, math.ceil(episodes / self.generation_batch_size))

    def steps_per_epoch(self, num_prompts: int) -> fractions.Fraction:
        """PPO updates per pass over `num_prompts` prompts: one per generation batch (the partial one dropped)."""
        return fractions.Fraction(num_prompts // self.prompts_per_generation)

    def resolved_stop_token_id(self, tokenizer: Any) -> int | None:
        """The id generation stops at: the tokenizer's EOS for stop_token `eos`, else stop_token_id (TRL)."""
        return int(tokenizer.eos_token_id) if self.stop_token == "eos" else self.stop_token_id

    def sampler_stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """TRL 1.12's PPO stops generation at its stop token only (none: every completion is full length)."""
        stop = self.resolved_stop_token_id(tokenizer)
        return () if stop is None else (stop,)

    def require_sources(self, num_rewards: int | None = None) -> None:
        _require(
            self.policy_path,
            "model_name_or_path is required: pass --model_name_or_path (or --sft_model_path) PATH_OR_HUB_ID (or "
            "run `python -m rloo_jax.train ppo` with no arguments for the built-in demo)",
        )
        if not self.resolved_value_model_path:
            raise ConfigError(
                "PPO needs a value model: set --value_model_path (a sequence-classification checkpoint, e.g. the "
                "reward model as TRL's scripts do, or a causal LM's folder: its backbone with a new score head), or "
                "--reward_model_path, which it then starts from"
            )
        super().require_sources(num_rewards)

    def step_options(self) -> dict[str, Any]:
        # TRL scales every log-prob's logits by 1 / (temperature + 1e-7); micro-batches are shuffled rows; every pad
        # id is padding (TRL's attention_mask = ids != pad); the rollout's log-probs are always a training forward's
        return {"logprob_temperature": (self.temperature or 1.0) + TEMPERATURE_EPS, "row_order": True,
                "pad_is_padding": True, "recompute_old_logps": True}

    @property
    def reference_sync(self) -> tuple[int, float] | None:
        return None

    def report_settings(self) -> dict[str, Any]:
        """Its batching and the other models it holds."""
        return {"num_ppo_epochs": self.num_ppo_epochs, "num_mini_batches": self.num_mini_batches,
                "kl_coef": self.kl_coef, "value_model": self.resolved_value_model_path,
                "reward_model": self.reward_model_path}

    # ----------------------------------------------------------------------------------------- validation
    def _check(self) -> None:
        if self.num_generations != 1:
            raise ConfigError("num_generations is not a PPO option (PPO samples one completion per prompt); drop "
                              "--num_generations")
        for name in ("num_ppo_epochs", "num_mini_batches"):
            _check(getattr(self, name) >= 1, name, "must be >= 1", getattr(self, name))
        _check(self.total_episodes is None or self.total_episodes >= 1, "total_episodes", "must be >= 1 or None",
               self.total_episodes)
        for name in ("cliprange", "cliprange_value"):
            _check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        _check(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]", self.gamma)
        _check(0 <= self.lam <= 1, "lam", "must be in [0, 1]", self.lam)
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ConfigError("set stop_token or stop_token_id, not both (TRL 1.12's PPOTrainer refuses both)")
        a, m = self.gradient_accumulation_steps, self.num_mini_batches
        local = self.per_device_train_batch_size * a
        if local % m:
            raise ConfigError(
                f"per_device_train_batch_size x gradient_accumulation_steps ({local}, TRL's local_batch_size) must "
                f"be a multiple of num_mini_batches ({m}); change one of them"
            )
        if a % m and m % a:
            raise ConfigError(
                f"num_mini_batches ({m}) must divide gradient_accumulation_steps ({a}) or be a multiple of it: else "
                "TRL 1.12 runs ragged micro-batches whose optimizer steps straddle PPO epochs and updates, which is "
                "not implemented here"
            )
        if self.whiten_rewards and self.local_mini_batch_size < 8:
            raise ConfigError(
                f"whiten_rewards needs at least 8 rows per mini-batch (TRL's assert), got {self.local_mini_batch_size}"
                " (per_device_train_batch_size x gradient_accumulation_steps / num_mini_batches); raise them or drop "
                "--whiten_rewards"
            )

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        if tokenizer is None:
            raise ValueError("PPOConfig.make_algorithm needs the policy's tokenizer (its pad and EOS ids)")
        return PPO(
            kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, missing_eos_penalty=self.missing_eos_penalty,
            whiten_rewards=self.whiten_rewards, gamma=self.gamma, lam=self.lam, cliprange=self.cliprange,
            cliprange_value=self.cliprange_value, vf_coef=self.vf_coef, num_ppo_epochs=self.num_ppo_epochs,
            num_mini_batches=self.num_mini_batches, gradient_accumulation_steps=self.gradient_accumulation_steps,
            pad_token_id=int(tokenizer.pad_token_id), eos_token_id=int(tokenizer.eos_token_id),
            stop_token_id=self.resolved_stop_token_id(tokenizer),
        )
