"""The one run configuration: `RLOOConfig` (TRL 1.16 `RLOOConfig` names), validation, YAML + command line.

`load_config(argv)` reads `--config FILE.yaml` (safe loader) first, then `--name value` / `--name=value`
overrides; values are parsed from the dataclass annotations. Every check runs once, in `RLOOConfig.validate()`
(called by `__post_init__`), and fails with one `ConfigError` naming the option and the fix.
"""

import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar, Literal

import yaml

from rloo_jax.data import parse_tfds_name
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.mesh import _resolve_mesh_shape
from rloo_jax.numerics import MatmulPrecision
from rloo_jax.quant import QuantSpec
from rloo_jax.tpu import parse_slice
from rloo_jax.trl_options import TABLES, is_trl_only, split_options

logger = logging.getLogger("rloo_jax")

# Old TRL (<= 0.21 RLOOConfig) names -> current names.
ALIASES = {
    "rloo_k": "num_generations",
    "kl_coef": "beta",
    "cliprange": "epsilon",
    "num_ppo_epochs": "num_iterations",
}
# TRL GRPO's names of the importance-sampling options (there between vLLM and the trainer) -> ours
VLLM_ALIASES = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_min": "importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max": "importance_sampling_clip_max",
    "vllm_importance_sampling_cap": "importance_sampling_clip_max",  # TRL's deprecated name of clip_max
}
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb")
DEFAULT_CACHE_DIR = os.environ.get("RLOO_JAX_CACHE", "~/.cache/rloo_jax")  # as build.CACHE_ROOT


def _opt(default: Any, group: str, help: str) -> Any:
    """A dataclass field carrying its `--help` text and help-section name."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, "group": group})
    return field(default=default, metadata={"help": help, "group": group})


@dataclass
class TrainConfig:
    """What every run needs, whatever the algorithm: model, memory, LoRA, rewards, data, generation, the shared
    algorithm knobs (KL coefficient, clipping, iterations, the old log-probs and the sampler/trainer correction),
    optimisation, logging and the mesh. `RLOOConfig` and `GRPOConfig` add their algorithm's own fields. Field names
    and defaults follow TRL 1.16 (bf16 is off by default on CPU). Derived values are properties, never stored."""

    ALGORITHM: ClassVar[str] = ""
    """The algorithm's name on the command line (`python -m rloo_jax.train grpo`) and in config.yaml."""
    MIN_GENERATIONS: ClassVar[int] = 2
    STEPS_SPAN_GENERATIONS: ClassVar[bool] = True  # an optimizer step may span two generation batches (TRL's Trainer)
    """The fewest completions per prompt the algorithm takes (2: a baseline within each group; PPO: 1)."""

    # --- model
    model_name_or_path: str | None = _opt(
        None,
        "model",
        "Policy model: a local Hugging Face folder (config.json + safetensors) or a hub id. `demo` builds "
        "the built-in tiny random-init Qwen2-shaped model (no network).",
    )
    reward_model_name_or_path: list[str] | None = _opt(
        None,
        "model",
        "Reward model(s) (sequence classification with one label): local folders or hub ids, "
        "comma-separated. Scored before the functions of `reward_funcs` (as TRL's `trl rloo` script), in this "
        "order.",
    )
    trust_remote_code: bool = _opt(
        False,
        "model",
        "Accepted for TRL compatibility. rloo_jax never executes code shipped with a model: only the config "
        "and safetensors weights are read, so this option changes nothing.",
    )
    bf16: bool | None = _opt(
        None,
        "model",
        "Compute in bfloat16: matmuls in bfloat16 with float32 accumulation; master weights and optimizer stay in "
        "param_dtype / mu_dtype, the frozen reference model's matrices are stored in bfloat16. None: on for TPU "
        "and GPU (and --compile_only), as TRL on GPUs; off on CPU, where bf16 is not faster at small sizes.",
    )
    matmul_precision: MatmulPrecision | None = _opt(
        None,
        "model",
        "Precision of float32 matmuls in the whole run (training, sampling, evaluation, reward models, "
        "--compile_only), MaxText's option with jax's values: default (= bfloat16: one bfloat16 pass on TPU, TF32 "
        "on NVIDIA GPUs), high (= tensorfloat32; three bfloat16 passes on TPU), highest (= float32). None: highest "
        "when bf16 is off (a float32 run computes in float32 on every backend), default with bf16 (its matmuls "
        "take bfloat16 inputs). XLA:CPU computes float32 matmuls in float32 whatever the value. "
        "docs/numerics.md.",
    )

    attn_implementation: Literal["eager", "splash", "cudnn"] | None = _opt(
        None,
        "model",
        "How the forwards compute attention (transformers' option name): eager (einsums with a float32 [T, S] score "
        "matrix per head: the reference), splash (Pallas flash attention for TPU, shipped in jax), cudnn (cuDNN "
        "flash attention on GPU through jax.nn.dot_product_attention; bf16 compute). None: splash on TPU (and "
        "--compile_only), cudnn on GPU with --bf16, eager otherwise. The fused kernels keep no [T, S] matrix in "
        "memory (docs/scale.md); decoding uses its one-query einsum with any of them.",
    )

    # --- memory
    gradient_checkpointing: bool | None = _opt(
        None,
        "memory",
        "Rematerialise each transformer block in the backward pass (TRL's option): the update keeps what "
        "remat_policy names of each block instead of every activation of every block, for up to one more forward "
        "pass of compute. None: on for TPU and GPU (and --compile_only), as TRL's default, off on CPU, where "
        "memory is not the limit and it cost 13% of the small benchmark model's update (BENCHMARKS.md).",
    )
    remat_policy: Literal["full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full_offloaded"] = _opt(
        "full",
        "memory",
        "With gradient_checkpointing, what each block keeps for the backward pass (MaxText's names): full (only "
        "the block's input: the least memory), minimal (every projection output: q, k, v, o, gate, up, down), "
        "save_dot_except_mlp (q, k, v, o), save_qkv_proj (q, k, v), full_offloaded (as full, with the block "
        "inputs in host memory; TPU/GPU only).",
    )
    scan_layers: bool | None = _opt(
        None,
        "memory",
        "Run the transformer blocks as one jax.lax.scan over their stacked parameters (compile time nearly flat "
        "in depth), or unrolled over a list of blocks: the same numbers, and the same Hugging Face export; "
        "checkpoints keep the layout they were written with. None: scan on TPU and GPU (and for --compile_only), "
        "unrolled on CPU, where XLA copies a layer's slice of stacked weights at every use (BENCHMARKS.md).",
    )
    param_dtype: Literal["float32", "bfloat16"] = _opt(
        "float32",
        "memory",
        "Storage dtype of the policy's master weights and gradients. bfloat16 halves them (AdamW then updates "
        "bfloat16 weights: small updates may round away).",
    )
    mu_dtype: Literal["float32", "bfloat16"] | None = _opt(
        None,
        "memory",
        "Storage dtype of AdamW's first moment (optax's mu_dtype); None keeps param_dtype. The second moment "
        "stays in param_dtype.",
    )
    compile_only: bool = _opt(
        False,
        "memory",
        "Build the run as training would, compile its per-step programs for --topology with the TPU compiler "
        "and report per-chip memory against the chip's HBM, FLOPs and bytes against the model's (decode against "
        "its memory floor), a roofline time from the chip's published peaks and compile time; write "
        "compile_report.json to output_dir, then exit (0: fits, 1: does not). Reads config.json and the "
        "tokenizer, no weights and no dataset; needs the `tpu` extra (libtpu), not a TPU.",
    )
    topology: str | None = _opt(
        None,
        "memory",
        "The TPU slice --compile_only compiles for, as Google Cloud names it: v5e-8 (or v5litepod-8), v5p-8 "
        "(4 chips), v4-8 (4 chips), v6e-8, any size. Mesh options and batch sizes apply to its chips.",
    )

    # --- LoRA (TRL's ModelConfig names)
    use_peft: bool = _opt(
        False,
        "peft",
        "Train LoRA adapters on a frozen base instead of the whole model. The base is stored once, in the compute "
        "dtype, and is also the reference model (adapters off: no reference copy; the KL at the first step is 0; "
        "starting from given adapters, a PEFT adapter folder or PeftModel, the reference is the base with a frozen "
        "copy of them, as TRL's); "
        "only the adapters are in the gradients, the optimizer state and the checkpoints. final/ is then a PEFT "
        "adapter folder (adapter_config.json + adapter_model.safetensors).",
    )
    lora_r: int = _opt(16, "peft", "LoRA rank r: A [in, r], B [r, out].")
    lora_alpha: int = _opt(32, "peft", "LoRA alpha: the adapter's output is scaled by lora_alpha / lora_r.")
    lora_dropout: float = _opt(
        0.05,
        "peft",
        "Dropout on the adapters' input in the update's forward passes (not in sampling or the reference); the "
        "masks are drawn from seed and step, so a resumed run draws the same ones.",
    )
    lora_target_modules: list[str] | None = _opt(
        None,
        "peft",
        "Projections with adapters, as Hugging Face names them (comma-separated): q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj (Llama/Qwen2/Mistral); query_key_value, dense, dense_h_to_4h, "
        "dense_4h_to_h (GPT-NeoX); or all-linear (every projection of the blocks). None: peft's default for the "
        "model (q_proj,v_proj; query_key_value).",
    )
    use_rslora: bool = _opt(
        False, "peft", "rsLoRA: scale the adapter's output by lora_alpha / sqrt(lora_r) instead of lora_alpha / lora_r."
    )
    merge_adapter_on_export: bool = _opt(
        False,
        "peft",
        "With use_peft, also write <output_dir>/final_merged: the base model with the adapters folded into its "
        "weights (W + lora_alpha / lora_r * A B), a plain Hugging Face folder.",
    )
    # --- QLoRA: a quantized frozen base (TRL's ModelConfig names; bitsandbytes' formats, docs/lora.md)
    load_in_4bit: bool = _opt(
        False,
        "peft",
        "QLoRA: store the frozen base's block projections in 4 bits (bnb_4bit_quant_type; blocks of 64 inputs, "
        "one float32 absmax each), quantized once from the checkpoint and dequantized to the compute dtype inside "
        "every forward; embeddings, LM head and norms stay in the compute dtype. Needs use_peft.",
    )
    load_in_8bit: bool = _opt(
        False,
        "peft",
        "QLoRA with an int8 base: the block projections as int8 with one float32 scale per output channel "
        "(weight-only: activations stay in the compute dtype). Needs use_peft.",
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = _opt(
        "nf4", "peft", "The 4-bit codebook with load_in_4bit: nf4 (QLoRA's NormalFloat) or fp4 (bitsandbytes' FP4)."
    )
    use_bnb_nested_quant: bool = _opt(
        False,
        "peft",
        "With load_in_4bit, double quantization (bitsandbytes' bnb_4bit_use_double_quant): the 4-bit scales as "
        "uint8 codes of one float32 scale per 256 output columns, 0.5 -> 0.13 bits per weight of scales.",
    )

    # --- rewards
    reward_funcs: list[str] | None = _opt(
        None,
        "rewards",
        "Comma-separated reward functions: `module:function` or TRL's dotted `module.function` (called with "
        "TRL's keyword arguments: prompts, completions, completion_ids, trainer_state, log_extra, log_metric and "
        "the dataset's other columns; returning list[float | None]; sync or async), built-in names (`accuracy`, "
        "`format`, `soft_overlong`, or TRL's `accuracy_reward`, `think_format_reward`, "
        "`get_soft_overlong_punishment`) or reward-model paths. `accuracy` compares answers with math-verify, the "
        "`math` extra (pip install 'rloo_jax[math]'); without it, by the last \\boxed{}, #### or number.",
    )
    reward_weights: list[float] | None = _opt(
        None,
        "rewards",
        "Weights for each reward function, in the order of `reward_model_name_or_path` then `reward_funcs`. "
        "Must match the number of reward functions. If None, all rewards are weighted equally with weight "
        "1.0.",
    )
    format_reward_pattern: str = _opt(
        r"^<think>(?!.*<think>)(.*?)</think>.*$",
        "rewards",
        "Regex (DOTALL | MULTILINE, `re.match`) of the built-in `format` reward: 1.0 when the completion "
        "matches, else 0.0.",
    )
    soft_overlong_cache: int = _opt(
        0,
        "rewards",
        "L_cache of the built-in `soft_overlong` reward (DAPO soft overlong punishment): completions longer "
        "than max_completion_length - L_cache get a linear penalty down to -1. 0 means "
        "max_completion_length // 4.",
    )

    # --- data
    dataset_name: str | None = _opt(
        None,
        "data",
        "Prompt dataset: a hub id, a local `save_to_disk` folder, a local .json/.jsonl/.parquet/.csv file, "
        "or `tfds:<name>[/<config>][:<version>]`, a tensorflow-datasets dataset prepared in tfds_data_dir "
        "(needs the `tfds` extra). Needs a `prompt` column (text, or a list of chat messages); other columns "
        "are passed to reward functions as keyword arguments. `demo` writes the built-in task.",
    )
    dataset_config: str | None = _opt(
        None,
        "data",
        "Dataset configuration name (hub datasets; for `tfds:` the same as tfds:<name>/<config>).",
    )
    tfds_data_dir: str | None = _opt(
        None,
        "data",
        "Where `tfds:` datasets are prepared: a local folder or a bucket URL (gs://bucket/tensorflow_datasets), "
        "holding <name>/[<config>/]<version>/ as `tfds build --data_dir` writes it. None: $TFDS_DATA_DIR, else "
        "~/tensorflow_datasets. Nothing is ever downloaded; prepared as array_record, the data is read without "
        "TensorFlow. The splits take TFDS slicing: train[:90%], train[90%:], train[:10%]+test.",
    )
    dataset_train_split: str = _opt(
        "train",
        "data",
        "Dataset split to train on.",
    )
    dataset_test_split: str = _opt(
        "test",
        "data",
        "Dataset split to evaluate on (used when eval_steps is set).",
    )
    shuffle_dataset: bool = _opt(
        True,
        "data",
        "Whether to shuffle the training dataset (a new order each epoch, from the seed).",
    )
    max_prompt_length: int | None = _opt(
        512,
        "data",
        "Maximum prompt length in tokens; longer prompts are truncated from the left (and counted). None "
        "keeps every prompt whole.",
    )
    prompt_bucket: int = _opt(
        64,
        "data",
        "Pad prompt batches (on the left) to a multiple of this many tokens, so the sampler compiles once "
        "per bucket instead of once per length.",
    )
    chat_template_kwargs: dict | None = _opt(
        None,
        "data",
        "Additional keyword arguments to pass to the `apply_chat_template` function (conversational "
        "prompts), as YAML/JSON, e.g. `{enable_thinking: false}`.",
    )

    # --- generation
    num_generations: int = _opt(
        2,
        "generation",
        "Number of generations to sample per prompt (G). The generation batch (per_device_train_batch_size "
        "* steps_per_generation) must be evenly divisible by this value.",
    )
    num_generations_eval: int | None = _opt(
        None,
        "generation",
        "Number of generations per prompt during evaluation. If None, uses num_generations.",
    )
    max_completion_length: int = _opt(
        512,
        "generation",
        "Maximum length of the generated completion.",
    )
    completion_bucket: int = _opt(
        128,
        "generation",
        "Run the reference pass and the update at the smallest completion_bucket * 2^k that holds the generation "
        "batch's longest completion (EOS included; a completion without EOS takes the whole "
        "max_completion_length), instead of always at max_completion_length: the same results without computing "
        "on padding, at most log2(max_completion_length / completion_bucket) + 1 compiled widths. 0: always "
        "max_completion_length.",
    )
    temperature: float = _opt(
        1.0,
        "generation",
        "Temperature for sampling (and for the log-probs). The higher the temperature, the more random the "
        "completions.",
    )
    top_k: int = _opt(
        0,
        "generation",
        "Number of highest probability vocabulary tokens to keep for top-k-filtering. If 0, top-k-filtering "
        "is disabled and all tokens are considered.",
    )
    top_p: float = _opt(
        1.0,
        "generation",
        "Float that controls the cumulative probability of the top tokens to consider. Must be in (0, 1]. "
        "Set to 1.0 to consider all tokens.",
    )
    min_p: float | None = _opt(
        None,
        "generation",
        "Minimum token probability, which will be scaled by the probability of the most likely token. It "
        "must be a value between 0.0 and 1.0. Typical values are in the 0.01-0.2 range.",
    )
    repetition_penalty: float = _opt(
        1.0,
        "generation",
        "Float that penalizes new tokens based on whether they appear in the prompt and the generated text "
        "so far. Values > 1.0 encourage the model to use new tokens, while values < 1.0 encourage "
        "repetition.",
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

    # --- optimization
    learning_rate: float = _opt(
        1e-6,
        "optimization",
        "The initial learning rate for AdamW.",
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = _opt(
        "linear",
        "optimization",
        "The learning-rate schedule (counted in optimizer steps).",
    )
    warmup_ratio: float = _opt(
        0.0,
        "optimization",
        "Fraction of the optimizer steps used for a linear warmup from 0 (older transformers' name; see "
        "warmup_steps).",
    )
    warmup_steps: float = _opt(
        0,
        "optimization",
        "Linear warmup from 0 (transformers 5 / TRL 1.16): an integer >= 1 is a number of optimizer steps, a "
        "float in [0, 1) a fraction of them. Set warmup_steps or warmup_ratio, not both.",
    )
    weight_decay: float = _opt(
        0.0,
        "optimization",
        "AdamW weight decay.",
    )
    max_grad_norm: float = _opt(
        1.0,
        "optimization",
        "Clip gradients to this global norm (0 disables clipping).",
    )
    max_consecutive_nonfinite: int = _opt(
        5,
        "optimization",
        "An update whose loss or gradients hold NaN/inf is skipped (params and optimizer state kept, counted as "
        "skipped_steps); after this many consecutive skips training stops with exit code 1.",
    )
    adam_beta1: float = _opt(
        0.9,
        "optimization",
        "AdamW beta1.",
    )
    adam_beta2: float = _opt(
        0.999,
        "optimization",
        "AdamW beta2.",
    )
    adam_epsilon: float = _opt(
        1e-8,
        "optimization",
        "AdamW epsilon.",
    )
    per_device_train_batch_size: int = _opt(
        8,
        "optimization",
        "Completions per device per optimizer micro-step (as in TRL; not prompts).",
    )
    gradient_accumulation_steps: int = _opt(
        1,
        "optimization",
        "Micro-steps accumulated into one optimizer step.",
    )
    steps_per_generation: int | None = _opt(
        None,
        "optimization",
        "Micro-steps per generation: one generation holds per_device_train_batch_size * "
        "steps_per_generation completions. If None, it defaults to gradient_accumulation_steps.",
    )
    max_steps: int = _opt(
        -1,
        "optimization",
        "Total optimizer steps. -1 derives it from num_train_epochs.",
    )
    num_train_epochs: float = _opt(
        3.0,
        "optimization",
        "Passes over the training prompts (used when max_steps is -1).",
    )
    seed: int = _opt(
        42,
        "optimization",
        "Random seed: initialization of the demo model, data order and sampling.",
    )
    full_determinism: bool = _opt(
        False,
        "optimization",
        "Run-to-run deterministic GPU programs (TRL's option): XLA's deterministic-ops flag is set before the JAX "
        "backend starts, so two runs with the same seed log the same metrics and a resumed run continues "
        "bit-exactly on GPU too. Costs GPU speed (deterministic scatter for the embedding gradient, no "
        "timing-based kernel choice); TPU and CPU programs are deterministic without it. docs/numerics.md.",
    )

    # --- logging
    output_dir: str = _opt(
        "outputs/rloo",
        "logging",
        "Where metrics.jsonl, rollouts.jsonl, config.yaml, checkpoints/ and final/ go: a local folder or a URL "
        "(gs://bucket/run, s3://...; needs gcsfs / s3fs). A run started again with the same output_dir resumes "
        "there (docs/outputs.md).",
    )
    logging_steps: int = _opt(
        10,
        "logging",
        "Log metrics every this many optimizer steps.",
    )
    log_completions: bool = _opt(
        False,
        "logging",
        "Write every completion of a logged step to rollouts.jsonl (the last step is always written) and "
        "print a sample.",
    )
    num_completions_to_print: int | None = _opt(
        None,
        "logging",
        "Number of completions to print when log_completions is set. If None, all are printed.",
    )
    run_name: str | None = _opt(
        None,
        "logging",
        "A name for the run: the W&B run name (the run id is kept in output_dir/wandb_run_id, so a resumed run "
        "continues the same W&B run).",
    )
    report_to: list[str] = _opt(
        ["none"],
        "logging",
        "Extra metric sinks, comma-separated: none, tensorboard (needs the `tensorboard` extra), wandb "
        "(needs the `wandb` extra). metrics.jsonl is always written.",
    )
    save_steps: int = _opt(
        500,
        "logging",
        "Save a checkpoint every this many optimizer steps (and at the end).",
    )
    save_total_limit: int | None = _opt(
        None,
        "logging",
        "Keep at most this many checkpoints (None keeps all).",
    )
    export_dtype: Literal["auto", "bfloat16", "float16", "float32"] = _opt(
        "auto",
        "logging",
        "dtype of the weights in final/ and final_merged/ (and of `python -m rloo_jax.export`): auto is the base "
        "model's config.json dtype (bfloat16 for most hub models, as transformers saves them; float32 for a float32 "
        "base); float32 keeps the float32 master weights (updates smaller than a bfloat16 step survive).",
    )
    export_max_shard_size: str = _opt(
        "50GB",
        "logging",
        "Largest weights file of an export; bigger models are written as model-0000i-of-0000n.safetensors shards "
        "with a model.safetensors.index.json, as transformers 5's save_pretrained (whose default this is).",
    )
    eval_steps: int | None = _opt(
        None,
        "logging",
        "Evaluate on dataset_test_split every this many optimizer steps (None: no evaluation).",
    )
    per_device_eval_batch_size: int = _opt(
        8,
        "logging",
        "Completions per device per evaluation batch (the evaluation batch is this times the data-parallel "
        "shards, data_parallel * fsdp); it must hold whole groups of the evaluation num_generations.",
    )
    compilation_cache: bool = _opt(
        True,
        "logging",
        "Use JAX's persistent compilation cache (later runs skip most compilation).",
    )
    compilation_cache_dir: str = _opt(
        os.path.join(DEFAULT_CACHE_DIR, "jax_cache"),
        "logging",
        "Folder of the persistent compilation cache.",
    )
    debug: bool = _opt(
        False,
        "logging",
        "Show full tracebacks for configuration and data errors.",
    )

    # --- distributed
    data_parallel: int = _opt(
        1,
        "distributed",
        "Size of the mesh axis `data`: parameters replicated, the batch split. With one device the mesh "
        "options are ignored (everything runs on that device).",
    )
    fsdp: int = _opt(
        -1,
        "distributed",
        "Size of the mesh axis `fsdp`: the batch split, and parameters plus optimizer state split along the "
        "hidden dimension (FSDP). -1 = the devices left after data_parallel and tensor_parallel.",
    )
    tensor_parallel: int = _opt(
        1,
        "distributed",
        "Size of the mesh axis `tensor`: MLP, attention heads and vocabulary split over devices (Megatron "
        "style). data_parallel * fsdp * tensor_parallel must equal the number of devices of all processes.",
    )
    rollout_mesh: tuple[int, int, int] | None = _opt(
        None,
        "distributed",
        "The sampler's own (data, fsdp, tensor) mesh over the same devices, e.g. 1,1,8 (-1: the devices left): "
        "the policy's weights move into its layout once per generation, decode runs on it, and its completions "
        "come back in the training layout. With fsdp 1 each device decodes from its whole tensor shard (no "
        "per-step weight gathers); tensor > 1 splits heads, MLP columns, vocabulary and the KV cache's heads. "
        "None: where training splits the weights over fsdp, the whole weights on every device if one "
        "compute-dtype copy takes at most 1/4 of a device's memory, else tensor-parallel over as many devices as "
        "the KV heads allow if that share fits, data-parallel over the rest; else (or on CPU) the training mesh "
        "(docs/scale.md). Compile-only, Llama-3.1-8B LoRA r 64 on v5e-8: 1 x 1 x 8 chosen, decode 45.5 -> 7.2 GB "
        "per step and chip, estimated step 82.6 -> 23.0 s.",
    )
    coordinator_address: str | None = _opt(
        None,
        "distributed",
        "host:port of process 0 for a multi-process run (or the JAX_COORDINATOR_ADDRESS environment "
        "variable). SLURM, Open MPI and TPU-pod launches are detected without it.",
    )
    num_processes: int | None = _opt(
        None,
        "distributed",
        "Number of processes of a multi-process run, with coordinator_address (or JAX_NUM_PROCESSES).",
    )
    process_id: int | None = _opt(
        None,
        "distributed",
        "This process's index, 0 .. num_processes - 1, with coordinator_address (or JAX_PROCESS_ID).",
    )

    # Facts of the machine, not options: devices of all processes and the number of processes. The trainer
    # passes jax.device_count() / jax.process_count() (after starting the multi-process runtime); the batch
    # sizes and the mesh are validated against them. Kept by dataclasses.replace, never written to YAML.
    device_count: InitVar[int] = 1
    process_count: InitVar[int] = 1

    def __post_init__(self, device_count: int, process_count: int) -> None:
        if not (isinstance(device_count, int) and isinstance(process_count, int)) or not (
            1 <= process_count <= device_count
        ):
            raise ConfigError(
                f"device_count ({device_count!r}) and process_count ({process_count!r}) must be integers with "
                "1 <= process_count <= device_count"
            )
        self.device_count = device_count
        self.process_count = process_count
        self.validate()

    # ----------------------------------------------------------------------------------------- derived values
    @property
    def resolved_steps_per_generation(self) -> int:
        """steps_per_generation, defaulting to gradient_accumulation_steps (TRL)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(data, fsdp, tensor) sizes on `device_count` devices, the -1 resolved: 8 devices, fsdp -1 -> (1, 8, 1)."""
        sizes = {"data_parallel": self.data_parallel, "fsdp": self.fsdp, "tensor_parallel": self.tensor_parallel}
        try:
            data, fsdp, tensor = _resolve_mesh_shape(sizes, self.device_count)
        except ValueError as e:
            raise ConfigError(f"{e}; fix --data_parallel / --fsdp / --tensor_parallel") from None
        return data, fsdp, tensor

    @property
    def quant_spec(self) -> QuantSpec | None:
        """How the frozen base is stored (load_in_4bit / load_in_8bit; `rloo_jax.quant`), None: unquantized."""
        if self.load_in_4bit:
            return QuantSpec(self.bnb_4bit_quant_type, self.use_bnb_nested_quant)
        return QuantSpec("int8") if self.load_in_8bit else None

    @property
    def data_shards(self) -> int:
        """Devices the batch is split over (data_parallel * fsdp): TRL's number of processes, one per device."""
        data, fsdp, _ = self.mesh_shape
        return data * fsdp

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation, all devices together (B*G): per-device batch x data shards x steps."""
        return self.per_device_train_batch_size * self.data_shards * self.resolved_steps_per_generation

    @property
    def eval_batch_size(self) -> int:
        """Completions per evaluation batch, all devices together: per_device_eval_batch_size x data shards."""
        return self.per_device_eval_batch_size * self.data_shards

    @property
    def prompts_per_generation(self) -> int:
        """Prompts per generation (B)."""
        return self.generation_batch_size // self.num_generations

    @property
    def micro_per_generation(self) -> int:
        """Micro-batch calls per generation batch (TRL's generate_every): steps_per_generation x num_iterations."""
        return self.resolved_steps_per_generation * self.resolved_num_iterations

    @property
    def on_policy(self) -> bool:
        """Every micro-batch's forward runs at the parameters it was sampled with (TRL's rule:
        gradient_accumulation_steps a multiple of steps_per_generation x num_iterations)."""
        return self.gradient_accumulation_steps % self.micro_per_generation == 0

    @property
    def resolved_num_iterations(self) -> int:
        """Optimisation passes over each generation batch (PPO: num_ppo_epochs)."""
        return self.num_iterations

    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a reference policy (beta > 0; PPO: always)."""
        return self.beta > 0

    @property
    def reference_copies_given_adapters(self) -> bool:
        """LoRA from given adapters (a PeftModel, a PEFT adapter folder): whether the reference is the base with a
        frozen copy of them (TRL 1.16's RLOO / GRPO: its "ref" adapter) rather than the base with the adapters off
        (TRL 1.12's PPO: `disable_adapter()`)."""
        return True

    @property
    def policy_path(self) -> str | None:
        """The policy's checkpoint (PPO: sft_model_path when set, as TRL's scripts)."""
        return self.model_name_or_path

    @property
    def tokenizer_path(self) -> str | None:
        """Where the tokenizer is read (the policy's folder; PPO: model_name_or_path, as TRL's scripts)."""
        return self.policy_path

    @property
    def steps_per_generation_batch(self) -> int:
        """What one generation batch advances the step counter (max_steps, save_steps, logging_steps, the learning
        rate schedule) by: its optimizer steps (TRL's Trainer), or 1 where a step is a generation batch (TRL 1.12's
        PPO counts updates). Where steps_per_generation x num_iterations is not a multiple of
        gradient_accumulation_steps a step may span two generation batches (`rloo_jax.step.UpdatePlan`): the
        whole steps a generation batch holds, at least 1 (what the timings are divided by)."""
        return max(1, self.micro_per_generation // self.gradient_accumulation_steps)

    def total_steps(self, num_prompts: int) -> int:
        """Steps of the run: max_steps, else num_train_epochs passes over `num_prompts` prompts (the partial batch
        at an epoch's end dropped)."""
        if self.max_steps > 0:
            return self.max_steps
        batches = num_prompts // self.prompts_per_generation
        # the micro-batches of the run's generation batches, gradient_accumulation_steps per optimizer step
        return int(math.ceil(self.num_train_epochs * batches)) * self.micro_per_generation \
            // self.gradient_accumulation_steps

    def step_options(self) -> dict[str, Any]:
        """`rloo_jax.step.StepConfig` options the algorithm sets beyond the shared ones (none here)."""
        return {}

    @property
    def uses_value_model(self) -> bool:
        """Whether the run trains a value model (PPO)."""
        return False

    @property
    def device_reward_paths(self) -> list[str]:
        """Reward models scored on the token ids on the device (the first `reward_sources`); the others run on the
        host (`rloo_jax.rewards`)."""
        return []

    def prepare_tokenizer(self, tokenizer: Any) -> None:
        """Make the loaded tokenizer what the algorithm needs (nothing here); ConfigError if it cannot."""

    def sampler_stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a completion: the tokenizer's EOS and generation_config.json's (`eos_ids`)."""
        return eos_ids

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def resolved_num_generations_eval(self) -> int:
        return self.num_generations_eval or self.num_generations

    @property
    def reward_sources(self) -> list[str]:
        """Reward functions in scoring order: reward_model_name_or_path, then reward_funcs (TRL's script order)."""
        return list(self.reward_model_name_or_path or []) + list(self.reward_funcs or [])

    @property
    def resolved_reward_weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights else [1.0] * len(self.reward_sources)

    @property
    def resolved_soft_overlong_cache(self) -> int:
        return self.soft_overlong_cache or max(1, self.max_completion_length // 4)

    # ----------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every invariant once; raise one `ConfigError` naming the option and the fix."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], f.name))
        if self.num_generations < self.MIN_GENERATIONS:
            raise ConfigError(
                f"num_generations must be >= 2 for a baseline within each prompt's group (got "
                f"{self.num_generations}); set --num_generations 2 or more"
            )
        for name in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_iterations",
            "max_completion_length",
            "prompt_bucket",
            "logging_steps",
            "save_steps",
            "ref_model_sync_steps",
            "per_device_eval_batch_size",
            "max_consecutive_nonfinite",
        ):
            _check(getattr(self, name) >= 1, name, "must be >= 1", getattr(self, name))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _check(math.isfinite(value), f.name, "must be a finite number", value)
        for name in (
            "steps_per_generation",
            "max_prompt_length",
            "save_total_limit",
            "eval_steps",
            "num_generations_eval",
        ):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, "must be >= 1 or None", value)
        self._validate_distributed()
        if self.generation_batch_size % self.num_generations:
            shards, spg = self.data_shards, self.resolved_steps_per_generation
            step = self.num_generations // math.gcd(self.num_generations, shards * spg)
            if shards == 1:
                formula = (
                    f"per_device_train_batch_size * steps_per_generation = {self.per_device_train_batch_size} * {spg}"
                )
            else:
                data, fsdp, _ = self.mesh_shape
                formula = (
                    f"per_device_train_batch_size * data-parallel shards (data_parallel * fsdp = {data} * {fsdp}) * "
                    f"steps_per_generation = {self.per_device_train_batch_size} * {shards} * {spg}"
                )
            raise ConfigError(
                f"the generation batch {formula} = {self.generation_batch_size} completions must be divisible by "
                f"num_generations = {self.num_generations} (whole prompt groups); change "
                f"per_device_train_batch_size to a multiple of {step}"
            )
        if self.prompts_per_generation % self.process_count:
            raise ConfigError(
                f"the {self.prompts_per_generation} prompts of a generation batch cannot be split evenly over "
                f"{self.process_count} processes (each samples and rewards its own prompts); make "
                "per_device_train_batch_size * data_parallel * fsdp * steps_per_generation / num_generations a "
                f"multiple of {self.process_count}"
            )
        if not self.STEPS_SPAN_GENERATIONS and self.resolved_steps_per_generation % self.gradient_accumulation_steps:
            raise ConfigError(
                f"steps_per_generation ({self.resolved_steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}): an optimizer step cannot "
                "span two generation batches"
            )
        g_eval = self.resolved_num_generations_eval
        if self.eval_steps is not None and self.eval_batch_size % g_eval:
            shards = "" if self.data_shards == 1 else f" x {self.data_shards} data-parallel shards"
            raise ConfigError(
                f"per_device_eval_batch_size ({self.per_device_eval_batch_size}){shards} must be divisible by the "
                f"evaluation num_generations ({g_eval}); change one of them"
            )
        if self.eval_steps is not None and (self.eval_batch_size // g_eval) % self.process_count:
            raise ConfigError(
                f"the {self.eval_batch_size // g_eval} prompts of an evaluation batch cannot be split evenly over "
                f"{self.process_count} processes; change per_device_eval_batch_size or num_generations_eval"
            )
        _check(
            self.max_steps == -1 or self.max_steps >= 1,
            "max_steps",
            "must be >= 1 (or -1 to use num_train_epochs)",
            self.max_steps,
        )
        _check(self.num_train_epochs > 0, "num_train_epochs", "must be > 0", self.num_train_epochs)
        _check(self.learning_rate > 0, "learning_rate", "must be > 0", self.learning_rate)
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)", self.warmup_ratio)
        _check(self.warmup_steps >= 0 and (self.warmup_steps < 1 or float(self.warmup_steps).is_integer()),
               "warmup_steps", "must be an integer >= 1 (steps) or a float in [0, 1) (a fraction)", self.warmup_steps)
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError("set warmup_steps or warmup_ratio, not both (warmup_steps < 1 is a fraction too)")
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        _check(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)", self.max_grad_norm)
        for name in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, name) < 1, name, "must be in [0, 1)", getattr(self, name))
        _check(self.adam_epsilon > 0, "adam_epsilon", "must be > 0", self.adam_epsilon)
        _check(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]; 1.0 disables it", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be >= 0; 0 disables it", self.top_k)
        _check(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1] or None", self.min_p)
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0; 1.0 disables it",
            self.repetition_penalty,
        )
        _check(self.beta >= 0, "beta", "must be >= 0 (0 drops the reference model)", self.beta)
        _check(self.epsilon > 0, "epsilon", "must be > 0", self.epsilon)
        _check(
            self.epsilon_high is None or self.epsilon_high > 0,
            "epsilon_high",
            "must be > 0 or None",
            self.epsilon_high,
        )
        _check(
            0 <= self.ref_model_mixup_alpha <= 1,
            "ref_model_mixup_alpha",
            "must be in [0, 1]",
            self.ref_model_mixup_alpha,
        )
        self._validate_importance_sampling()
        _check(self.lora_r >= 1, "lora_r", "must be >= 1", self.lora_r)
        _check(self.lora_alpha > 0, "lora_alpha", "must be > 0", self.lora_alpha)
        _check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)", self.lora_dropout)
        _check(_is_size(self.export_max_shard_size), "export_max_shard_size", "must be a size such as 5GB or 500MB",
               self.export_max_shard_size)
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit and load_in_8bit both set: choose one (the base is stored in 4 or 8 bits)")
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_peft:
            name = "load_in_4bit" if self.load_in_4bit else "load_in_8bit"
            raise ConfigError(f"{name} quantizes the frozen base of LoRA (QLoRA): pass --use_peft, or drop --{name} "
                              "(a quantized model cannot be trained whole)")
        if self.use_bnb_nested_quant and not self.load_in_4bit:
            raise ConfigError("use_bnb_nested_quant quantizes the scales of a 4-bit base: pass --load_in_4bit, or "
                              "drop --use_bnb_nested_quant")
        if self.merge_adapter_on_export and not self.use_peft:
            raise ConfigError("merge_adapter_on_export merges LoRA adapters, but use_peft is off; pass --use_peft or "
                              "drop --merge_adapter_on_export")
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
        _check(self.soft_overlong_cache >= 0, "soft_overlong_cache", "must be >= 0", self.soft_overlong_cache)
        _check(self.completion_bucket >= 0, "completion_bucket", "must be >= 0 (0: no bucketing)",
               self.completion_bucket)
        _check(
            self.num_completions_to_print is None or self.num_completions_to_print >= 0,
            "num_completions_to_print",
            "must be >= 0 or None",
            self.num_completions_to_print,
        )
        for sink in self.report_to:
            if sink not in REPORT_TO_CHOICES:
                raise ConfigError(f"report_to: unknown sink {sink!r}; choose from {', '.join(REPORT_TO_CHOICES)}")
        if self.compile_only and self.topology is None:
            raise ConfigError("compile_only needs a TPU slice to compile for: pass --topology, e.g. v5e-8 or v5p-8")
        if self.topology is not None:
            parse_slice(self.topology)  # one line listing the slice names when it is not one
        if (self.dataset_name or "").startswith("tfds:"):
            try:
                parse_tfds_name(self.dataset_name[len("tfds:") :], self.dataset_config)
            except DataError as e:
                raise ConfigError(f"dataset_name: {e}") from None
        elif self.tfds_data_dir is not None:
            raise ConfigError(
                f"tfds_data_dir is only read for `tfds:` datasets (dataset_name is {self.dataset_name!r}); drop "
                "--tfds_data_dir or pass --dataset_name tfds:<name>"
            )
        self._validate_algorithm()

    def __getattr__(self, name: str) -> Any:
        """TRL's options given to this config without a field here (see `_keep_trl_only`)."""
        kept = self.__dict__.get("_trl_options", {})
        if name in kept:
            return kept[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _validate_algorithm(self) -> None:
        """The algorithm's own checks (subclasses)."""

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        """The algorithm value the step composes (``rloo_jax.algorithms``), from this config (`tokenizer`: the
        policy's, for algorithms that need its token ids)."""
        raise NotImplementedError(f"{type(self).__name__} names no algorithm; use RLOOConfig or GRPOConfig")

    def require_sources(self, num_rewards: int | None = None) -> None:
        """What a run needs beyond valid options: a model, a dataset and at least one reward, with one weight per
        reward. `num_rewards`: the reward functions given some other way (the Python API); default: the ones
        named by reward_model_name_or_path and reward_funcs. The CLI checks this when it reads its config;
        `RLOOTrainer` once its arguments are in."""
        _require(
            self.policy_path,
            "model_name_or_path is required: pass --model_name_or_path "
            "PATH_OR_HUB_ID (or run with no arguments for the built-in demo)",
        )
        _require(
            self.dataset_name,
            "dataset_name is required: pass --dataset_name HUB_ID_OR_PATH (a local "
            ".jsonl with a `prompt` column works)",
        )
        count = len(self.reward_sources) if num_rewards is None else num_rewards
        if not count:
            raise ConfigError(
                "no reward: set --reward_funcs (functions `module:function` or built-in names) "
                "and/or --reward_model_name_or_path"
            )
        if self.reward_weights is not None and len(self.reward_weights) != count:
            names = f" ({', '.join(self.reward_sources)})" if num_rewards is None else ""
            raise ConfigError(
                f"Number of reward weights ({len(self.reward_weights)}) must match number of reward functions "
                f"({count}{names}); give one weight per function, in that order"
            )

    def _validate_importance_sampling(self) -> None:
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

    def _validate_distributed(self) -> None:
        """Mesh sizes fit the devices (raises through `mesh_shape`); explicit process options are consistent."""
        self.mesh_shape  # noqa: B018 - resolving the mesh is the check
        if self.rollout_mesh is not None:
            sizes = dict(zip(("data", "fsdp", "tensor"), self.rollout_mesh, strict=True))
            try:
                _resolve_mesh_shape(sizes, self.device_count)
            except ValueError as e:
                raise ConfigError(f"rollout_mesh: {e}; give data,fsdp,tensor sizes whose product is the device count "
                                  "(one may be -1), or leave it unset") from None
        _check_processes(self.num_processes, self.process_id)

    # ----------------------------------------------------------------------------------------- export
    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready values (tuples become lists), the algorithm's name first."""
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"algorithm": self.ALGORITHM, **values}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


@dataclass
class RLOOConfig(TrainConfig):
    """Everything one RLOO run needs: `TrainConfig` and RLOO's own fields, with TRL 1.16's `RLOOConfig` names and
    defaults (KL in the reward, leave-one-out baseline, sequence-level clipped objective)."""

    ALGORITHM: ClassVar[str] = "rloo"

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

    def _validate_algorithm(self) -> None:
        if self.reward_clip_range is not None and not self.reward_clip_range[0] < self.reward_clip_range[1]:
            raise ConfigError(f"reward_clip_range must be (min, max) with min < max (got {self.reward_clip_range})")
        if self.importance_sampling_correction and self.importance_sampling_mode.startswith("token_"):
            raise ConfigError(
                f"importance_sampling_mode {self.importance_sampling_mode} weights each token's loss, but RLOO's loss "
                "is per sequence (TRL's RLOO): use sequence_mask or sequence_truncate (token modes need a token-level "
                "loss: GRPO, or the Python API's RLOO(level='token'))"
            )

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        from rloo_jax.algorithms import RLOO

        return RLOO(
            beta=self.beta, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            normalize_advantages=self.normalize_advantages, reward_clip_range=self.reward_clip_range,
            mask_truncated_completions=self.mask_truncated_completions, missing_eos_penalty=self.missing_eos_penalty,
            kl_estimator=self.kl_estimator, token_level_kl=self.token_level_kl,
        )


_SCALE_REWARDS = {"true": "group", "false": "none"}  # TRL's GRPOConfig maps the booleans


@dataclass
class GRPOConfig(TrainConfig):
    """Everything one GRPO run needs: `TrainConfig` and GRPO's own fields, with TRL 1.16's `GRPOConfig` names and
    defaults (group-relative advantages, the KL as a k3 term of the loss, eight loss types; beta 0 and 8
    generations by default)."""

    ALGORITHM: ClassVar[str] = "grpo"

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

    def _validate_algorithm(self) -> None:
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
        from rloo_jax.algorithms import GRPO

        names = [f.name for f in dataclasses.fields(GRPO) if f.name != "max_completion_length"]
        return GRPO(**{name: getattr(self, name) for name in names},
                    max_completion_length=self.max_completion_length)


_PPO_DOES_NOT_READ = {  # TrainConfig fields of RLOO / GRPO that TRL 1.12's PPO has no use for -> what PPO has instead
    "beta": "PPO's KL coefficient is kl_coef",
    "epsilon": "PPO's clip range is cliprange",
    "epsilon_high": "PPO clips symmetrically with cliprange (cliprange_value for the value model)",
    "num_iterations": "PPO's passes over a batch are num_ppo_epochs",
    "steps_per_generation": "PPO's micro-batches follow from gradient_accumulation_steps and num_mini_batches",
    "num_generations": "PPO samples one completion per prompt",
    "mask_truncated_completions": "PPO has missing_eos_penalty for completions without EOS",
    "importance_sampling_correction": "PPO's rollout log-probs are always a training forward's (TRL 1.12)",
    "importance_sampling_mode": "PPO has no importance-sampling correction",
    "importance_sampling_clip_min": "PPO has no importance-sampling correction",
    "importance_sampling_clip_max": "PPO has no importance-sampling correction",
    "recompute_old_logps": "PPO always recomputes the rollout log-probs with a training forward",
    "sync_ref_model": "PPO's reference stays the initial policy (TRL 1.12)",
    "ref_model_mixup_alpha": "PPO's reference stays the initial policy (TRL 1.12)",
    "ref_model_sync_steps": "PPO's reference stays the initial policy (TRL 1.12)",
    "reward_model_name_or_path": "PPO's reward model is reward_model_path: it scores the token ids on the "
                                 "device, as TRL's PPOTrainer does (the policy's tokenizer)",
    "max_grad_norm": "TRL 1.12's PPOTrainer never clips gradients",
}


@dataclass
class PPOConfig(TrainConfig):
    """Everything one PPO run needs: `TrainConfig` and PPO's own fields, with TRL 1.12's `PPOConfig` names and
    defaults (`trl.experimental.ppo`: a value model, GAE, the clipped policy and value losses, PPO epochs over
    shuffled mini-batches). A step is one PPO update (a generation batch), as TRL counts them; `response_length`
    is TRL's name of `max_completion_length`. TRL's sampler options are temperature only; the sampler's others
    (top_k, top_p, min_p, repetition_penalty) work here as for the other trainers. docs/ppo.md."""

    ALGORITHM: ClassVar[str] = "ppo"
    MIN_GENERATIONS: ClassVar[int] = 1
    STEPS_SPAN_GENERATIONS: ClassVar[bool] = False  # its optimizer steps stay inside a PPO update

    # --- TRL 1.12 PPOConfig's defaults for shared fields
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
    logging_steps: int = _opt(
        1,
        "logging",
        "Log metrics every this many PPO updates (TRL 1.12's PPO logs every update, whatever its logging_steps: "
        "default 1 here).",
    )
    max_grad_norm: float = _opt(0.0, "optimization", "TRL 1.12's PPOTrainer never clips gradients (fixed at 0).")
    recompute_old_logps: bool | None = _opt(
        True,
        "algorithm",
        "PPO's rollout log-probs come from a training forward at the sampling parameters (fixed).",
    )

    # --- PPO's own (TRL 1.12 PPOConfig)
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

    # ----------------------------------------------------------------------------------------- derived values
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

    def step_options(self) -> dict[str, Any]:
        from rloo_jax.algorithms.ppo import TEMPERATURE_EPS

        # TRL scales every log-prob's logits by 1 / (temperature + 1e-7); micro-batches are shuffled rows; every pad
        # id is padding (TRL's attention_mask = ids != pad)
        return {"logprob_temperature": (self.temperature or 1.0) + TEMPERATURE_EPS, "row_order": True,
                "pad_is_padding": True}

    def resolved_stop_token_id(self, tokenizer: Any) -> int | None:
        """The id generation stops at: the tokenizer's EOS for stop_token `eos`, else stop_token_id (TRL)."""
        return int(tokenizer.eos_token_id) if self.stop_token == "eos" else self.stop_token_id

    def sampler_stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """TRL 1.12's PPO stops generation at its stop token only (none: every completion is full length)."""
        stop = self.resolved_stop_token_id(tokenizer)
        return () if stop is None else (stop,)

    # ----------------------------------------------------------------------------------------- validation
    def _validate_algorithm(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, instead in _PPO_DOES_NOT_READ.items():
            if getattr(self, name) != defaults[name]:
                raise ConfigError(f"{name} is not a PPO option ({instead}); drop --{name}")
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

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        from rloo_jax.algorithms import PPO

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


CONFIGS: dict[str, type[TrainConfig]] = {c.ALGORITHM: c for c in (RLOOConfig, GRPOConfig, PPOConfig)}


def _take_trl_options(cls: type[TrainConfig]) -> None:
    """`RLOOConfig(**kwargs)` / `GRPOConfig(**kwargs)` also take TRL's option names (`use_vllm=False`,
    `push_to_hub=False`, ...), decided by `rloo_jax.trl_options` as the YAML and the command line are, so a TRL
    script's config line runs here; a misspelt name gets the command line's "did you mean" error. Without
    device_count, the batch sizes and mesh are checked for the devices and processes JAX sees (with several
    processes, call `jax.distributed.initialize()` first)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        if "device_count" not in kwargs:  # built in Python: checked for the devices JAX sees (TRL: its processes)
            import jax

            kwargs.update(device_count=jax.device_count(), process_count=jax.process_count())
        machine = {k: kwargs.pop(k) for k in ("device_count", "process_count")}
        kwargs = {canonical_name(k, f"{cls.__name__}(...)", cls): v for k, v in kwargs.items()}
        ours, checks = split_options(kwargs, _hints(cls), decisions(cls))
        init(self, *args, **ours, **machine)
        for check in checks:
            check(self)
        _keep_trl_only(self, kwargs)

    cls.__init__ = __init__


for _cls in (RLOOConfig, GRPOConfig, PPOConfig):
    _take_trl_options(_cls)


def _keep_trl_only(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """The TRL options `cfg` took that are no field of it (accepted without effect, translated, or refused at their
    off value) stay readable as attributes, as on TRL's config (`cfg.push_to_hub`, `cfg.use_vllm`)."""
    table = decisions(type(cfg))
    kept = {k: v for k, v in values.items() if k in table and k not in {f.name for f in dataclasses.fields(cfg)}}
    object.__setattr__(cfg, "_trl_options", {**getattr(cfg, "_trl_options", {}), **kept})


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """`dataclasses.replace` that keeps the TRL options `cfg` holds without fields (`_keep_trl_only`)."""
    new = dataclasses.replace(cfg, **changes)
    object.__setattr__(new, "_trl_options", dict(getattr(cfg, "_trl_options", {})))
    return new


def decisions(cls: type[TrainConfig]) -> dict[str, Any]:
    """The TRL option table of a config class (`rloo_jax.trl_options`)."""
    return TABLES[cls.ALGORITHM]


def _is_size(size: str) -> bool:
    """A size huggingface_hub reads ("5GB", "500MB", "1000"), as transformers' max_shard_size."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return int(size) > 0 if str(size).isdigit() else parse_size_to_int(size) > 0
    except ValueError:
        return False


def _require(value: Any, message: str) -> None:
    if not value:
        raise ConfigError(message)


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} {rule} (got {value!r}); fix --{name}")


def _check_processes(num_processes: int | None, process_id: int | None) -> None:
    _check(num_processes is None or num_processes >= 1, "num_processes", "must be >= 1 or None", num_processes)
    _check(process_id is None or process_id >= 0, "process_id", "must be >= 0 or None", process_id)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ConfigError(
            f"process_id ({process_id}) must be below num_processes ({num_processes}); processes are numbered "
            "0 .. num_processes - 1"
        )


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type[TrainConfig] = None) -> dict[str, Any]:
    cls = RLOOConfig if cls is None else cls
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


# ---------------------------------------------------------------------------------------------- value parsing
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_NONE = {"none", "null", "~"}


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Parse `value` (a command-line string or a YAML scalar/list/dict) into `annotation`'s type.

    bool accepts true/false/1/0/yes/no; lists and tuples accept comma-separated strings; `None`/`null` gives
    None for optional fields; dicts accept YAML/JSON text.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            if len(non_none) < len(args):
                return None
            raise ConfigError(f"{name} cannot be None")
        return coerce(value, non_none[0], name)
    if origin is Literal:
        text = str(value)
        if text not in args:
            near = difflib.get_close_matches(text, [str(a) for a in args], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{name}: {text!r} is not one of {', '.join(map(str, args))}{hint}")
        return text
    if origin in (list, tuple):
        items = _split_list(value, name)
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(coerce(v, args[0], name) for v in items)
            if len(items) != len(args):
                raise ConfigError(f"{name} needs {len(args)} comma-separated values (got {value!r})")
            return tuple(coerce(v, a, name) for v, a in zip(items, args, strict=True))
        return [coerce(v, args[0] if args else str, name) for v in items]
    if annotation is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}: cannot parse {value!r} as a YAML/JSON mapping ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping like `{{key: value}}` (got {value!r})")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(f"{name} must be true/false/1/0 (got {value!r})")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer (got {value!r})")
        try:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer (got {value!r})") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number (got {value!r})")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number (got {value!r})") from None
    if annotation is str:
        if isinstance(value, list | dict):
            raise ConfigError(f"{name} must be a single value (got {value!r})")
        return str(value)
    raise TypeError(f"unsupported annotation {annotation!r} for {name}")


def _split_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")) and text.endswith(("]", ")")):
            text = text[1:-1]
        return [v.strip() for v in text.split(",") if v.strip()]
    return [value]


# ------------------------------------------------------------------------------------------------ sources
def field_names(cls: type[TrainConfig] = None) -> list[str]:
    return [f.name for f in dataclasses.fields(RLOOConfig if cls is None else cls)]


def canonical_name(name: str, source: str, cls: type[TrainConfig] = None) -> str:
    """Map an option name (or an old TRL alias) to a field name of `cls` (or a TRL option its table decides), or
    fail suggesting the nearest one."""
    cls = RLOOConfig if cls is None else cls
    name = name.replace("-", "_")
    table, fields = decisions(cls), field_names(cls)
    if name in fields or name in table:  # ours, or one of TRL's (decided in trl_options)
        return name
    if name in ALIASES:
        new = ALIASES[name]
        logger.warning("note: `%s` is the old TRL name of `%s` (TRL <= 0.21); using %s", name, new, new)
        return new
    if name in VLLM_ALIASES:
        new = VLLM_ALIASES[name]
        logger.warning("note: `%s` is TRL GRPO's name of `%s` (here between our sampler and trainer); using %s",
                       name, new, new)
        return new
    near = difflib.get_close_matches(name, fields + list(ALIASES) + list(VLLM_ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean --{near[0]}?" if near else "; see --help for the list"
    other = [c.__name__ for c in CONFIGS.values() if c is not cls and name in field_names(c)]
    if other:
        hint = f" ({name} is an option of {other[0]}, not of {cls.__name__}){hint}"
    raise ConfigError(f"unknown option {name!r} in {source}{hint}")


def read_yaml(path: str, cls: type[TrainConfig] = None) -> dict[str, Any]:
    """Read a YAML config file (safe loader) into {field_name: raw value} (its `algorithm` key aside)."""
    data = _load_yaml(path)
    return {canonical_name(str(k), path, cls): v for k, v in data.items() if k != "algorithm"}


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of option: value (got {type(data).__name__})")
    return data


def config_class(argv: Sequence[str], base: dict[str, Any] | None = None) -> tuple[type[TrainConfig], list[str]]:
    """The algorithm a command line asks for, and the rest of it: `[rloo|grpo] [--config FILE] [--name value ...]`.
    The first word names it; else the `--config` file's `algorithm:` key (config.yaml records it); else `base`'s;
    else RLOO. A word and a file that disagree are an error."""
    argv = list(argv)
    named = None
    if argv and not argv[0].startswith("-"):
        named = argv.pop(0)
        if named not in CONFIGS:
            near = difflib.get_close_matches(named, list(CONFIGS), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown algorithm {named!r}{hint}: the first word names one of {', '.join(CONFIGS)}")
    path = next((a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
                 for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    recorded = _load_yaml(path).get("algorithm") if path else (base or {}).get("algorithm")
    if recorded is not None and str(recorded) not in CONFIGS:
        raise ConfigError(f"{path or 'the config'}: algorithm {recorded!r} is not one of {', '.join(CONFIGS)}")
    if named and recorded and named != recorded:
        raise ConfigError(f"the command line names {named} but {path} is a {recorded} config (algorithm: {recorded});"
                          " drop one of them")
    return CONFIGS[named or recorded or "rloo"], argv


def parse_argv(argv: Sequence[str], cls: type[TrainConfig] = None) -> tuple[str | None, dict[str, Any]]:
    """Split argv (without the algorithm word) into (the --config path, {field_name: raw string value}).

    Accepts `--name value` and `--name=value`; a bare boolean `--flag` means true.
    """
    cls = RLOOConfig if cls is None else cls
    config_path, overrides, i = None, {}, 0
    hints, table = _hints(cls), decisions(cls)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --name value or --name=value (the "
                              f"algorithm, one of {', '.join(CONFIGS)}, comes first)")
        key, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            name = key.replace("-", "_")
            if name not in hints and name not in table:
                name = ALIASES.get(name) or VLLM_ALIASES.get(name) or name
            takes_flag = hints.get(name) in (bool, bool | None) or is_trl_only(name, table)  # `--bf16` alone: true
            if i + 1 < len(argv) and not (takes_flag and argv[i + 1].startswith("--")):
                value, i = argv[i + 1], i + 1
            elif takes_flag:
                value = "true"
            else:
                raise ConfigError(f"option --{key} needs a value")
        i += 1
        if key == "config":
            config_path = value
        else:
            overrides[canonical_name(key, "the command line", cls)] = value
    return config_path, overrides


def _raw_values(argv: Sequence[str], base: dict[str, Any] | None) -> tuple[type[TrainConfig], dict[str, Any]]:
    cls, argv = config_class(argv, base)
    config_path, overrides = parse_argv(argv, cls)
    values = {k: v for k, v in (base or {}).items() if k != "algorithm"}
    if config_path is not None:
        values.update(read_yaml(config_path, cls))
    values.update(overrides)
    return cls, values


def load_config(
    argv: Sequence[str], base: dict[str, Any] | None = None, device_count: int = 1, process_count: int = 1
) -> TrainConfig:
    """The validated config of the algorithm `argv` names (`config_class`): `base` values, then the `--config`
    YAML file, then command-line overrides; batch sizes and mesh checked for `device_count` devices in
    `process_count` processes."""
    cls, values = _raw_values(argv, base)
    return config_from_dict(values, device_count, process_count, cls)


def compile_only_slice(argv: Sequence[str]) -> str | None:
    """The `--topology` of a `--compile_only` run (from `--config` and the command line), else None: read before
    the rest of the config is validated, because the batch and mesh checks count the slice's chips."""
    cls, values = _raw_values(argv, None)
    hints = _hints(cls)
    if not coerce(values.get("compile_only", False), hints["compile_only"], "compile_only"):
        return None
    return coerce(values.get("topology"), hints["topology"], "topology")


def full_determinism_option(argv: Sequence[str]) -> bool:
    """`--full_determinism` from `--config` and the command line, before the rest of the config is validated:
    XLA reads its flags when the JAX backend starts, which happens before the config can be checked."""
    return coerce(_raw_values(argv, None)[1].get("full_determinism", False), bool, "full_determinism")


def distributed_options(argv: Sequence[str]) -> tuple[str | None, int | None, int | None]:
    """(coordinator_address, num_processes, process_id) from `--config` and the command line, before the rest
    of the config is validated: the multi-process runtime must start first (the device count depends on it)."""
    cls, values = _raw_values(argv, None)
    hints = _hints(cls)
    names = ("coordinator_address", "num_processes", "process_id")
    address, count, index = (coerce(values.get(name), hints[name], name) for name in names)
    _check_processes(count, index)
    return address, count, index


def config_from_dict(values: dict[str, Any], device_count: int = 1, process_count: int = 1,
                     cls: type[TrainConfig] | None = None) -> TrainConfig:
    """Build a validated config from {name: raw value}; values are coerced to the annotated types. `cls`: the
    config class (default: the `algorithm` value's, else RLOOConfig)."""
    values = dict(values)
    recorded = values.pop("algorithm", None)
    if cls is None:
        if recorded is not None and str(recorded) not in CONFIGS:
            raise ConfigError(f"algorithm {recorded!r} is not one of {', '.join(CONFIGS)}")
        cls = CONFIGS[str(recorded or "rloo")]
    hints = _hints(cls)
    parsed = {canonical_name(k, "the config", cls): v for k, v in values.items()}
    parsed, checks = split_options(parsed, hints, decisions(cls))  # TRL's: refused, dropped with a note, translated
    parsed = {k: coerce(v, hints[k], k) for k, v in parsed.items()}
    trl_only = {k: v for k, v in values.items() if k in decisions(cls) and k not in hints}
    cfg = cls(**parsed, device_count=device_count, process_count=process_count)
    for check in checks:
        check(cfg)
    _keep_trl_only(cfg, trl_only)
    cfg.require_sources()
    return cfg


_GROUP_ORDER = ("model", "memory", "peft", "rewards", "data", "generation", "algorithm", "grpo", "ppo", "optimization",
                "logging", "distributed")


def format_help(cls: type[TrainConfig] = None) -> str:
    """`--help` text: usage, then every option of `cls` grouped, with its type, default and help text."""
    cls = RLOOConfig if cls is None else cls
    name = cls.ALGORITHM.upper()
    release = "1.12" if cls.ALGORITHM == "ppo" else "1.16"  # TRL 1.12 is the last release with PPOTrainer
    lines = [
        "usage: python -m rloo_jax.train [rloo|grpo|ppo] [--config FILE.yaml] [--name value | --name=value ...]",
        "",
        f"Train a causal LM with {name} (TRL {release}'s {name} trainer math) in JAX; the first word picks the "
        "algorithm "
        "(rloo by default, or the config file's `algorithm:`), e.g. `python -m rloo_jax.train grpo --help`. Options "
        "are read from the YAML file first, then from the command line. With neither --config nor "
        "--model_name_or_path, the built-in demo (configs/default.yaml: a tiny model on a synthetic task, no "
        "network) runs.",
        f"Old TRL names are accepted: {', '.join(f'{k} -> {v}' for k, v in ALIASES.items())}; so are TRL GRPO's "
        f"vllm_importance_sampling_* names. So is every other option of TRL {release}'s {cls.__name__} and `trl "
        f"{cls.ALGORITHM}` script: read without effect (named in a note) or refused with the reason "
        "(docs/trl_options.md).",
    ]
    hints = _hints(cls)
    fields = sorted(dataclasses.fields(cls), key=lambda f: _GROUP_ORDER.index(f.metadata["group"]))
    group = None
    for f in fields:
        if f.metadata["group"] != group:
            group = f.metadata["group"]
            lines += ["", f"{group}:"]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"  --{f.name} {_type_name(hints[f.name])}  (default: {json.dumps(default)})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.upper() if "[" not in text else text
