"""Every option of TRL's trainer configs and what rloo_jax does with it: the decisions every algorithm shares
(`SHARED`: transformers' TrainingArguments, TRL's ModelConfig and script arguments, and the options RLOO and GRPO
have in common), and the machinery that applies an algorithm's table to raw options. Each algorithm's own entries
are beside its config (`rloo_jax.algorithms.<name>_config`: `table(OWN, exclude=...)` is its `TRL_OPTIONS`).

TRL 1.16's `RLOOConfig` / `GRPOConfig` (their own fields and the ~115 they inherit from `TrainingArguments`), the
`trl rloo` / `trl grpo` scripts' `ModelConfig`, script arguments and dataset mixture, and TRL 1.12's PPO, so a TRL
YAML or a TRL Python script runs here unchanged. Each name is one of:

- **supported**: a config field here, same name and meaning (`why` notes a difference, if any);
- **accepted**: read and checked, but it changes nothing here (`why` says why); values outside `takes` are
  refused;
- **refused**: a feature rloo_jax does not have; only the values in `takes` (TRL's "off") are accepted.

`split_options` applies a table to raw options (YAML, command line, Python keyword arguments);
`scripts/trl_table.py` writes the README's migration table and docs/trl_options.md from the tables, and
tests/test_trl_options.py walks TRL's dataclasses so no field goes undecided. To change a decision (e.g. once
`push_to_hub` is implemented), edit its entry; an option that becomes a config field must be marked `supported`.
"""

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

from rloo_jax.errors import ConfigError

logger = logging.getLogger("rloo_jax")

Status = Literal["supported", "accepted", "refused"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one TRL option does here. `takes`: for accepted options the values taken (None: any), for refused
    ones the values that ask for nothing (TRL's off values), described for people by `takes_text`. `translate`:
    a TRL value -> our options (a dict of config fields), for options whose TRL type differs from ours."""

    status: Status
    why: str
    takes: Callable[[Any], bool] | None = None
    takes_text: str = ""
    translate: Callable[[Any], dict[str, Any]] | None = None
    check: Callable[[Any, Any], None] | None = None  # (the built config, the value): raises ConfigError if at odds
    topic: str = ""  # the table row it shares with options of the same decision (set by `_build`)


def supported(why: str = "", translate: Callable[[Any], dict[str, Any]] | None = None) -> Decision:
    return Decision("supported", why, translate=translate)


def accepted(why: str, takes: Callable[[Any], bool] | None = None, takes_text: str = "",
             translate: Callable[[Any], dict[str, Any]] | None = None,
             check: Callable[[Any, Any], None] | None = None) -> Decision:
    return Decision("accepted", why, takes, takes_text, translate, check)


def refused(why: str, takes: Callable[[Any], bool], takes_text: str) -> Decision:
    return Decision("refused", why, takes, takes_text)


# value predicates (raw YAML / command-line / Python values: "false" and False alike)
def _text(v: Any) -> str:
    return str(v).strip().lower()


def off(v: Any) -> bool:
    """None, false, 0, empty: the option asks for nothing."""
    return v is None or v is False or _text(v) in {"", "none", "null", "~", "false", "0", "no", "off", "[]", "{}"} \
        or (isinstance(v, list | tuple | dict) and not v)


def is_one_of(*values: str) -> Callable[[Any], bool]:
    return lambda v: _text(getattr(v, "value", v)) in values


def is_none(v: Any) -> bool:
    return v is None or _text(v) in {"none", "null", "~", ""}


def _integer_text(v: Any) -> bool:
    try:
        return not isinstance(v, bool) and float(v) == int(float(v))
    except (TypeError, ValueError):
        return False


def _fsdp(v: Any) -> dict[str, Any]:
    """TRL's `fsdp` (torch FSDP switches: True, "full_shard auto_wrap", ...) is not our mesh size: keep ours."""
    return {"fsdp": v} if _integer_text(v) else {}


def _debug(v: Any) -> dict[str, Any]:
    if isinstance(v, bool) or _text(v) in {"true", "false", "1", "0", "yes", "no", "on", "off"}:
        return {"debug": v}
    if off(v):
        return {}
    raise ConfigError(f"debug: {v!r} is one of transformers' torch debug modes; here --debug true/false shows full "
                      "tracebacks of configuration and data errors")


def _strategy(name: str, taken: tuple[str, ...], why: str) -> Callable[[Any], dict[str, Any]]:
    """transformers' IntervalStrategy / SaveStrategy option `name` (a string or the enum): steps and epoch are the
    field's values; `no` (where taken) turns evaluation off (eval_steps None); others are refused, saying `why`."""

    def translate(v: Any) -> dict[str, Any]:
        text = _text(getattr(v, "value", v))
        if text not in taken:
            raise ConfigError(f"{name}={v!r} cannot be honoured here: {why} (accepted: {', '.join(taken)})")
        return {"eval_steps": None} if text == "no" else {name: text}

    return translate


_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_torch_npu_fused",
          "adamw_apex_fused", "adamw_anyprecision")


def _optim(v: Any) -> dict[str, Any]:
    """transformers' optimizer names: the AdamW ones are optax AdamW; the 8- and 4-bit ones (bitsandbytes' and
    torchao's quantised states) are refused saying why and what saves optimizer memory here; others refused."""
    text = _text(getattr(v, "value", v))
    if text in _ADAMW:
        return {}
    if "8bit" in text or "4bit" in text:
        raise ConfigError(
            f"optim={v!r} is not supported here: optax has no 8-bit (or 4-bit) AdamW, and bitsandbytes' quantised "
            "optimizer states are torch CUDA kernels; to save optimizer memory use --mu_dtype bfloat16 (AdamW's "
            "first moment in bfloat16), --use_peft (optimizer state for the LoRA adapters only) or --fsdp (the "
            "state sharded over the devices), or pass optim adamw_torch (optax AdamW in float32)")
    raise ConfigError(f"optim={v!r} cannot be honoured here: the optimizer is optax AdamW (accepted: an AdamW name: "
                      f"{', '.join(_ADAMW)})")


def _same_generation_batch(cfg: Any, v: Any) -> None:
    """TRL's generation_batch_size (its dumps always hold it) must be the batch this run generates."""
    if is_none(v) or int(float(v)) == cfg.generation_batch_size:
        return
    raise ConfigError(
        f"generation_batch_size={v!r} is not this run's generation batch (per_device_train_batch_size "
        f"{cfg.per_device_train_batch_size} x {cfg.data_shards} data shards x steps_per_generation "
        f"{cfg.resolved_steps_per_generation} = {cfg.generation_batch_size}); set steps_per_generation instead"
    )


def _activation_checkpointing(v: Any) -> dict[str, Any]:
    return {} if off(v) else {"gradient_checkpointing": v}


def _attn(v: Any) -> dict[str, Any]:
    """transformers' torch attention kernels (sdpa, flash_attention_2/3, flex_attention, hub kernels) ask for a fast
    attention: here that is None, the fused kernel the platform has."""
    text = _text(v)
    return {"attn_implementation": None if is_none(v) or text not in {"eager", "splash", "cudnn"} else text}


def _bf16(v: Any) -> dict[str, Any]:
    return {} if is_none(v) else {"bf16": v}  # None: TRL's "on where supported", as bf16 None here


def _tf32(v: Any) -> dict[str, Any]:
    """TRL's tf32 (torch's float32 matmul mode) as our matmul_precision, which sets the same thing in XLA."""
    return {} if is_none(v) else {"matmul_precision": "tensorfloat32" if _text(v) in {"true", "1"} else "highest"}


def _dtype(v: Any) -> dict[str, Any]:
    return {"param_dtype": "bfloat16"} if _text(v) == "bfloat16" else {}


def _kwargs(name: str, v: Any) -> dict[str, Any]:
    """A TRL dict option as given: a dict (Python, YAML) or its JSON text (the command line)."""
    try:
        value = json.loads(v) if isinstance(v, str) else v
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}: {v!r} is not a JSON object ({e.msg}); pass e.g. '{{\"top_k\": 50}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: {v!r} is not a dict of keyword arguments")
    return value


def _refuse_keys(name: str, kwargs: dict[str, Any], taken: Iterable[str], why: str) -> None:
    unknown = sorted(set(kwargs) - set(taken))
    if unknown:
        raise ConfigError(f"{name}: {', '.join(unknown)} cannot be honoured here: {why} (taken: {', '.join(taken)})")


_SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _generation_kwargs(v: Any) -> dict[str, Any]:
    """TRL's generation_kwargs override the sampling options beside them (GenerationConfig(**defaults, **kwargs)):
    the sampler's five taken as those options; do_sample false is greedy decoding (top_k 1, whatever else is set)."""
    if off(v):
        return {}
    kwargs = _kwargs("generation_kwargs", v)
    _refuse_keys("generation_kwargs", kwargs, (*_SAMPLER_KEYS, "do_sample"),
                 "the sampler implements no other generate() argument")
    out = {k: kwargs[k] for k in _SAMPLER_KEYS if k in kwargs}
    if "do_sample" in kwargs and off(kwargs["do_sample"]):
        out["top_k"] = 1
    return out


def _model_init_kwargs(v: Any) -> dict[str, Any]:
    """TRL's from_pretrained arguments: the dtype (`dtype`, or transformers' older `torch_dtype`) as the `dtype`
    option, attn_implementation as that option; weights are read from safetensors, so nothing else applies."""
    if off(v):
        return {}
    kwargs = _kwargs("model_init_kwargs", v)
    _refuse_keys("model_init_kwargs", kwargs, ("dtype", "torch_dtype", "attn_implementation"),
                 "weights are read from safetensors into the Flax model")
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is not None and not is_one_of("float32", "bfloat16", "auto")(dtype):
        raise ConfigError(f"model_init_kwargs: dtype {dtype!r} cannot be honoured here (taken: float32, bfloat16, "
                          "auto); float16 needs loss scaling")
    out = {} if dtype is None else _dtype(dtype)
    return {**out, **(_attn(kwargs["attn_implementation"]) if "attn_implementation" in kwargs else {})}


def _lr_scheduler_kwargs(v: Any) -> dict[str, Any]:
    """transformers' schedule arguments: cosine_with_min_lr's floor; optax's cosine has one half-wave (num_cycles
    0.5, transformers' default)."""
    if off(v):
        return {}
    kwargs = _kwargs("lr_scheduler_kwargs", v)
    _refuse_keys("lr_scheduler_kwargs", kwargs, ("min_lr", "min_lr_rate", "num_cycles"),
                 "the schedules take no other argument")
    if "num_cycles" in kwargs and float(kwargs["num_cycles"]) != 0.5:
        raise ConfigError(f"lr_scheduler_kwargs: num_cycles {kwargs['num_cycles']!r} cannot be honoured here: the "
                          "cosine schedules are one half-wave (num_cycles 0.5)")
    return {k: kwargs[k] for k in ("min_lr", "min_lr_rate") if k in kwargs}


# -------------------------------------------------------------------------------------------------- the table
_VLLM = ("vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url "
         "vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization "
         "vllm_max_model_length vllm_tensor_parallel_size")
_GENERATION_ENGINE = "generation runs on the JAX sampler (prefill once per prompt, KV-cache decode)"
_NO_TORCH = "torch runtime settings: the step is one XLA program on a JAX device mesh"


SHARED: list[tuple[str, str, Decision]] = [
    # --- TRL's RLOOConfig / GRPOConfig: the algorithm, generation and logging
    ("algorithm", "beta num_iterations epsilon epsilon_high mask_truncated_completions reward_weights",
     supported("TRL 1.16's math (docs/research_api.md)")),
    ("reference sync (TR-DPO)", "sync_ref_model ref_model_mixup_alpha ref_model_sync_steps",
     supported("not with use_peft, as TRL (the reference is the frozen base, adapters off or a copy of "
               "given starting adapters)")),
    ("generation", "num_generations num_generations_eval max_completion_length temperature top_p top_k min_p "
     "repetition_penalty chat_template_kwargs shuffle_dataset", supported()),
    ("micro-batches and optimizer steps", "steps_per_generation gradient_accumulation_steps", supported(
        "TRL's stream of micro-batches: a generation every steps_per_generation x num_iterations of them, an "
        "optimizer step every gradient_accumulation_steps, so a step may hold the end of one generation batch and "
        "the start of the next (any two values; the partial gradient sum is carried in the train state and its "
        "checkpoints), and the run stops exactly at max_steps, inside a generation batch if need be. Differences: "
        "the generation batch is cut into micro-batches in order, where TRL first shuffles it with torch's RNG; "
        "and where a dataloader epoch's micro-batches are not a multiple of gradient_accumulation_steps, TRL's "
        "Trainer cuts the epoch's last optimizer step short, where here steps run on across epochs")),
    ("completion logging", "log_completions num_completions_to_print",
     supported("completions go to rollouts.jsonl (and a printed sample)")),
    ("trust_remote_code", "trust_remote_code",
     supported("never runs code shipped with a model: only config.json and safetensors are read")),
    ("vLLM settings", _VLLM, accepted("no vLLM: " + _GENERATION_ENGINE)),
    ("transformers generation", "use_transformers_continuous_batching use_transformers_paged "
     "transformers_continuous_batching_config", refused(_GENERATION_ENGINE, off, "false / None")),
    ("generation_kwargs", "generation_kwargs", accepted(
        "temperature, top_k, top_p, min_p and repetition_penalty override those options, as in TRL; do_sample "
        "false is greedy (top_k 1); other generate() arguments are refused",
        takes_text="a dict of temperature, top_k, top_p, min_p, repetition_penalty, do_sample",
        translate=_generation_kwargs)),
    ("generation_batch_size", "generation_batch_size", accepted(
        "a generation holds per_device_train_batch_size x data shards x steps_per_generation completions: set "
        "steps_per_generation", takes_text="the run's generation batch (TRL's dumps hold it)",
        check=_same_generation_batch)),
    ("cache_implementation", "cache_implementation",
     accepted("the sampler always decodes from its own static KV cache")),
    ("pad_to_multiple_of", "pad_to_multiple_of",
     accepted("prompts are always padded to a multiple of prompt_bucket and completions cut to completion_bucket "
              "widths (one compile per bucket)")),
    ("ds3_gather_for_generation", "ds3_gather_for_generation",
     accepted("no DeepSpeed; on a mesh the sampler gets its own layout, see rollout_mesh")),
    ("disable_dropout", "disable_dropout",
     accepted("the models here have no dropout (LoRA's lora_dropout aside): as TRL with disable_dropout true")),
    ("router_aux_loss_coef", "router_aux_loss_coef",
     supported("mixture-of-experts policies (Qwen3-MoE, GPT-OSS); added to each micro-batch's loss")),
    ("model_init_kwargs", "model_init_kwargs", accepted(
        "dtype (or torch_dtype) as the dtype option (bfloat16: param_dtype bfloat16), attn_implementation as that "
        "option; weights are read from safetensors, other from_pretrained arguments are refused",
        takes_text="a dict of dtype / torch_dtype (float32, bfloat16, auto), attn_implementation",
        translate=_model_init_kwargs)),
    ("completion table extras", "log_multimodal log_unique_prompts",
     accepted("text only; rollouts.jsonl keeps every completion of a recorded step")),
    # --- TrainingArguments: optimisation
    ("optimisation", "learning_rate per_device_train_batch_size num_train_epochs "
     "max_steps weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm seed output_dir",
     supported("optax AdamW, weight decay on matrices only (as transformers)")),
    ("lr_scheduler_type", "lr_scheduler_type", supported("linear, cosine, cosine_with_min_lr, constant, "
                                                         "constant_with_warmup")),
    ("warmup_steps", "warmup_steps", supported("an integer >= 1: steps; a float in [0, 1): a fraction of them")),
    ("lr_scheduler_kwargs", "lr_scheduler_kwargs", accepted(
        "cosine_with_min_lr's min_lr or min_lr_rate, as those options; num_cycles 0.5 (the half cosine) only",
        takes_text="a dict of min_lr, min_lr_rate, num_cycles 0.5", translate=_lr_scheduler_kwargs)),
    ("optim", "optim", accepted(
        "the optimizer is optax AdamW; optax has no 8-bit AdamW (adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit, ... "
        "are refused naming what saves optimizer memory here: mu_dtype bfloat16, use_peft, fsdp)",
        takes_text="an AdamW name (adamw_torch, adamw_torch_fused, ...)", translate=_optim)),
    ("optimizer extras", "optim_args optim_target_modules", refused("only AdamW, on every trained parameter", off,
                                                                     "None")),
    ("average_tokens_across_devices", "average_tokens_across_devices",
     accepted("the RLOO loss is a mean over sequences: no token counts to average")),
    ("label_smoothing_factor", "label_smoothing_factor", accepted("RLOO has no labels (TRL ignores it too)")),
    ("neftune_noise_alpha", "neftune_noise_alpha", refused("NEFTune noise is not implemented", is_none, "None")),
    ("auto_find_batch_size", "auto_find_batch_size", refused(
        "batch sizes are fixed; --compile_only --topology reports what fits a TPU slice", off, "false")),
    # --- precision and memory
    ("bf16", "bf16", supported("None (the default, TRL's auto): on for TPU and GPU, off on CPU", _bf16)),
    ("fp16", "fp16 fp16_full_eval", refused("float16 needs loss scaling, which is not implemented: use bf16", off,
                                            "false")),
    ("bf16_full_eval", "bf16_full_eval", accepted("evaluation samples in the training compute dtype")),
    ("tf32", "tf32", accepted("true sets matmul_precision tensorfloat32, false highest: XLA's float32 matmul mode "
                              "(docs/numerics.md)", lambda v: is_none(v) or _text(v) in {"true", "false", "1", "0"},
                              "true, false (as matmul_precision), None", _tf32)),
    ("full_determinism", "full_determinism",
     supported("XLA's deterministic GPU ops (CPU and TPU runs are deterministic without it; docs/numerics.md)")),
    ("gradient_checkpointing", "gradient_checkpointing",
     supported("per-block rematerialisation, what a block keeps is remat_policy; None: on for TPU/GPU, off on CPU")),
    ("activation_checkpointing", "activation_checkpointing", accepted(
        "transformers 5's new name of gradient_checkpointing: true turns it on", translate=_activation_checkpointing)),
    ("checkpointing extras", "gradient_checkpointing_kwargs activation_checkpointing_kwargs",
     accepted("what a block keeps is remat_policy")),
    ("torch.compile", "torch_compile torch_compile_backend torch_compile_mode",
     accepted("every step is already one XLA-compiled program")),
    ("Liger kernels", "use_liger_kernel liger_kernel_config",
     accepted("log-probs are always computed in vocabulary chunks, without the [N, C, V] logits")),
    ("use_cache", "use_cache", accepted("the sampler always uses its KV cache; the training passes never do")),
    ("torch memory", "torch_empty_cache_steps skip_memory_metrics", accepted(_NO_TORCH)),
    # --- logging and evaluation
    ("logging", "logging_steps report_to", supported(
        "logging_steps as transformers': an integer >= 1 (steps) or a float in (0, 1) (a ratio of the run's steps, "
        "ceil(total x ratio)); report_to: none, tensorboard, wandb (metrics.jsonl always)")),
    ("run_name", "run_name", supported("the W&B run name")),
    ("logging_strategy", "logging_strategy", accepted("logging is every logging_steps", is_one_of("steps"),
                                                      "steps")),
    ("logging extras", "logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen "
     "log_level log_level_replica disable_tqdm", accepted(
         "process 0 logs every logging_steps; num_tokens is always logged; non-finite updates are skipped and "
         "counted as skipped_steps")),
    ("project / trackio", "project trackio_space_id trackio_bucket_id trackio_static_space_id",
     accepted("no Trackio sink; the W&B project comes from WANDB_PROJECT")),
    ("eval_strategy", "eval_strategy", supported(
        "steps: every eval_steps; epoch: at the end of each pass over the training prompts (its optimizer steps as "
        "num_train_epochs counts them; not with an IterableDataset: no epochs); `no` sets eval_steps None; also at "
        "the end of the run", _strategy("eval_strategy", ("no", "steps", "epoch"), "evaluation runs every "
                                        "eval_steps or at each epoch's end"))),
    ("evaluation", "eval_steps per_device_eval_batch_size", supported(
        "reward and length statistics of sampled completions on dataset_test_split; eval_steps as transformers': an "
        "integer >= 1 (steps) or a float in (0, 1) (a ratio of the run's steps, ceil(total x ratio)); None "
        "(steps strategy): no evaluation")),
    ("evaluation extras", "prediction_loss_only eval_do_concat_batches eval_use_gather_object "
     "eval_accumulation_steps include_for_metrics batch_eval_metrics",
     accepted("evaluation reports reward and length statistics of sampled completions, not a loss")),
    ("eval timing", "eval_delay eval_on_start", refused("evaluation runs every eval_steps and at the end", off,
                                                        "0 / false")),
    # --- checkpoints and outputs
    ("save cadence", "save_steps save_total_limit", supported(
        "orbax checkpoints in output_dir/checkpoints; save_steps as transformers': an integer >= 1 (steps) or a "
        "float in (0, 1) (a ratio of the run's steps, ceil(total x ratio))")),
    ("save_strategy", "save_strategy", supported(
        "steps: every save_steps; epoch: at the end of each pass over the training prompts (not with an "
        "IterableDataset: no epochs); always at the end of the run too; `no` and `best` are refused",
        _strategy("save_strategy", ("steps", "epoch"), "a run always writes checkpoints (resume and final/ read "
                  "them; a larger save_steps writes fewer), and best needs metric_for_best_model, refused here"))),
    ("checkpoint extras", "save_only_model save_on_each_node restore_callback_states_from_checkpoint",
     accepted("a checkpoint always holds what resume needs (policy, optimizer, data position, RNG), written by "
              "every process together")),
    ("enable_jit_checkpoint", "enable_jit_checkpoint",
     accepted("a SIGTERM always finishes the step and saves a checkpoint")),
    ("resume_from_checkpoint", "resume_from_checkpoint", accepted(
        "the command line resumes from the newest checkpoint in output_dir on a rerun; in Python, pass it to "
        "train(), as transformers' Trainer takes it", lambda v: is_none(v) or _text(v) == "true",
        "None / true")),
    ("ignore_data_skip", "ignore_data_skip", accepted("resume restores the data position exactly, skipping nothing")),
    ("best model", "load_best_model_at_end metric_for_best_model greater_is_better",
     refused("final/ is the policy of the last step", off, "false / None")),
    ("push_to_hub", "push_to_hub", refused(
        "nothing is uploaded: push final/ (a Hugging Face folder) with `hf upload`", off, "false")),
    ("hub settings", "hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision",
     accepted("no effect without push_to_hub")),
    # --- data loading
    ("data loading", "dataloader_drop_last dataloader_num_workers dataloader_pin_memory "
     "dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context "
     "dataloader_in_order remove_unused_columns label_names length_column_name data_seed",
     accepted("prompts are read by index in the loop (no DataLoader); every column reaches the reward functions; "
              "the order follows seed")),
    ("train_sampling_strategy", "train_sampling_strategy", accepted(
        "a fresh shuffle per epoch (shuffle_dataset false: file order)", is_one_of("random"), "random")),
    # --- devices and processes
    ("fsdp", "fsdp", supported(
        "here the size of the fsdp mesh axis (-1: every device left): parameters and optimizer state are sharded "
        "by default; TRL's FSDP switches (true, full_shard ...) keep -1", _fsdp)),
    ("distributed runtime", "fsdp_config deepspeed accelerator_config ddp_find_unused_parameters ddp_bucket_cap_mb "
     "ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout local_rank",
     accepted("no torch distributed runtime: the mesh (data_parallel, fsdp, tensor_parallel) shards the step and "
              "jax.distributed joins the processes (docs/multihost.md)")),
    ("parallelism_config", "parallelism_config", refused("use data_parallel, fsdp and tensor_parallel", is_none,
                                                         "None")),
    ("use_cpu", "use_cpu", refused("set JAX_PLATFORMS=cpu to run on the CPU", off, "false")),
    ("debug", "debug", supported("true/false: full tracebacks of configuration and data errors; transformers' "
                                 "torch debug modes are refused", _debug)),
    ("script flags", "do_train do_eval do_predict", accepted("the trainer always trains; evaluation follows "
                                                             "eval_steps")),
    # --- the `trl rloo` script: model, LoRA and data arguments (ModelConfig, script arguments)
    ("model and data", "model_name_or_path dataset_name dataset_config dataset_train_split dataset_test_split",
     supported("local folders/files, hub ids, or `tfds:` datasets (docs/data.md)")),
    ("rewards", "reward_funcs reward_model_name_or_path", supported(
        "TRL's names (accuracy_reward, think_format_reward; get_soft_overlong_punishment reads max_completion_length "
        "and soft_overlong_cache, where TRL's script fixes 1280 / 256) and dotted paths work; "
        "reward_model_name_or_path is scored first, as TRL's script does")),
    ("LoRA", "use_peft lora_r lora_alpha lora_dropout lora_target_modules use_rslora",
     supported("the reference is the base with adapters off (a PeftModel or adapter folder: with a frozen copy "
               "of its adapters, as TRL); final/ is a PEFT adapter folder (docs/lora.md)")),
    ("lora_target_parameters", "lora_target_parameters",
     supported("a mixture of experts' mlp.experts.gate_up_proj / down_proj (peft's target_parameters: per-expert "
               "adapters, lora_dropout 0 as peft requires; docs/lora.md)")),
    ("lora_task_type", "lora_task_type", accepted("causal LMs only", is_one_of("causal_lm"), "CAUSAL_LM")),
    ("LoRA extras", "use_dora lora_modules_to_save",
     refused("DoRA and trained full modules are not implemented", off, "false / None")),
    ("quantisation (QLoRA)", "load_in_8bit load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant", supported(
        "with use_peft: the frozen base's block projections stored as bitsandbytes stores them (int8 per output "
        "channel; nf4 / fp4 in blocks of 64, its codebooks; nested: the scales in 8 bits), dequantized to the compute "
        "dtype in every forward (bnb_4bit_compute_dtype: as TRL, the model's dtype, here bf16 or float32); the LM "
        "head and embeddings stay unquantized (docs/lora.md)")),
    ("bnb_4bit_quant_storage", "bnb_4bit_quant_storage",
     accepted("the torch dtype bitsandbytes packs 4-bit codes into; here they are JAX's uint4, two to a byte in TPU "
              "memory")),
    ("model_revision", "model_revision", refused(
        "download that revision and pass its folder as model_name_or_path", is_one_of("main", "none", ""), "main")),
    ("dtype", "dtype", accepted("the policy's weights are kept in param_dtype (bfloat16 here sets param_dtype "
                                "bfloat16)", is_one_of("float32", "bfloat16", "auto", "none", ""),
                                "float32, bfloat16, auto", _dtype)),
    ("attn_implementation", "attn_implementation", supported(
        "eager (the einsum), splash (Pallas, TPU) or cudnn (GPU, bf16); None picks the fused one where the platform "
        "has it; transformers' torch kernels (sdpa, flash_attention_2, ...) become None (docs/scale.md)", _attn)),
    ("ignore_bias_buffers", "ignore_bias_buffers", accepted("torch DDP only")),
    ("dataset streaming", "dataset_streaming streaming",
     accepted("a dataset split is read whole (the Python API also takes an IterableDataset)")),
    ("dataset mixtures", "datasets test_split_size",
     refused("pass one dataset_name (or a Dataset to RLOOTrainer)", off, "[] / None")),
]


def table(own: list[tuple[str, str, Decision]], exclude: Iterable[str] = ()) -> dict[str, Decision]:
    """An algorithm's table: its `own` groups of (topic, names, decision), then the `SHARED` groups (TRL's
    TrainingArguments, ModelConfig, script arguments and the options RLOO and GRPO share) but the names it decides
    itself and those its TRL release does not have (`exclude`)."""
    skip = set(exclude) | {name for _, names, _ in own for name in names.split()}
    shared = []
    for topic, names, decision in SHARED:
        kept = [n for n in names.split() if n not in skip]
        if kept:
            shared.append((topic, " ".join(kept), decision))
    return _build(own + shared)


def _build(groups: list[tuple[str, str, Decision]]) -> dict[str, Decision]:
    table: dict[str, Decision] = {}
    for topic, names, decision in groups:
        for name in names.split():
            if name in table:
                raise ValueError(f"{name} is decided twice")
            table[name] = dataclasses.replace(decision, topic=topic)
    return table


def is_trl_only(name: str, decisions: dict[str, Decision]) -> bool:
    """A TRL option that is not a config field here (accepted or refused)."""
    return name in decisions and decisions[name].status != "supported"


def split_options(values: dict[str, Any], fields: Iterable[str], decisions: dict[str, Decision]
                  ) -> tuple[dict[str, Any], list[Callable[[Any], None]]]:
    """Apply a config class's table (`TRL_OPTIONS`) to raw options: refuse what asks for a missing feature
    (`ConfigError`, one line), drop what changes nothing (one note naming them), translate TRL-typed values. Returns
    our config fields and the checks to run on the built config (`check(cfg)`: options that must agree with it)."""
    fields = set(fields)
    if "vllm_importance_sampling_correction" in decisions and ("use_vllm" in values or
                                                              "vllm_importance_sampling_correction" in values):
        # TRL corrects vLLM's samples only: its correction (default on) counts only with use_vllm
        on = not off(values.get("vllm_importance_sampling_correction", True)) and not off(values.get("use_vllm"))
        values = dict(values, vllm_importance_sampling_correction=on)
    ours: dict[str, Any] = {}
    translated: dict[str, Any] = {}  # applied last: `eval_strategy: no` wins over an eval_steps set anywhere
    checks: list[Callable[[Any], None]] = []
    ignored: list[str] = []
    for name, value in values.items():
        decision = decisions.get(name)
        if decision is None:
            ours[name] = value  # one of ours (unknown names are refused by the caller)
            continue
        if decision.status != "supported" and decision.takes is not None and not decision.takes(value):
            verb = "is not supported here" if decision.status == "refused" else "cannot be honoured here"
            raise ConfigError(f"{name}={value!r} {verb}: {decision.why} (accepted: {decision.takes_text})")
        if decision.check is not None:
            checks.append(lambda cfg, check=decision.check, value=value: check(cfg, value))
        if decision.translate is not None:
            translated.update(decision.translate(value))
        elif name in fields:
            ours[name] = value
        elif not off(value) and not decision.takes_text:  # (values taken conditionally are what happens here)
            ignored.append(name)
    ours.update(translated)
    if ignored:
        logger.warning("note: TRL options with no effect here: %s (see the migration table in the README)",
                       ", ".join(ignored))
    return ours, checks


# ------------------------------------------------------------------------------------------- the migration tables
def _names(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _rows(decisions: dict[str, Decision]) -> list[tuple[str, list[str], Decision]]:
    """(topic, names, decision) per group, in table order."""
    rows: dict[str, tuple[list[str], Decision]] = {}
    for name, decision in decisions.items():
        rows.setdefault(decision.topic, ([], decision))[0].append(name)
    return [(topic, names, decision) for topic, (names, decision) in rows.items()]


def _status(decision: Decision) -> str:
    if decision.status == "refused":
        return f"refused (`{decision.takes_text}` accepted)"
    if decision.status == "accepted" and decision.takes_text:
        return f"accepted: {decision.takes_text}"
    return decision.status


def full_table(decisions: dict[str, Decision]) -> str:
    """docs/trl_options.md's table: every option, grouped by decision."""
    lines = ["| TRL option | here | why |", "|---|---|---|"]
    lines += [f"| {_names(names)} | {_status(d)} | {d.why or 'same name and meaning'} |"
              for _, names, d in _rows(decisions)]
    return "\n".join(lines)


def summary_table(decisions: dict[str, Decision]) -> str:
    """The README's table: what is supported, what is refused (exit 2) and what is read without effect."""
    rows = _rows(decisions)
    supported_names = [n for _, names, d in rows if d.status == "supported" for n in names]
    plain = [n for _, names, d in rows if d.status == "accepted" and not d.takes_text for n in names]
    lines = ["| TRL 1.16 options | here | why |", "|---|---|---|",
             f"| {len(supported_names)} options: {_names(supported_names)} | supported | same names; the notes: "
             "[docs/trl_options.md](docs/trl_options.md) |"]
    lines += [f"| {_names(names)} | {_status(d)} | {d.why} |" for _, names, d in rows
              if d.status == "refused" or (d.status == "accepted" and d.takes_text)]
    lines.append(f"| {len(plain)} more: {_names(plain)} | accepted, no effect | named in one note at the start; why "
                 "for each: [docs/trl_options.md](docs/trl_options.md) |")
    return "\n".join(lines)
