"""The run configuration every algorithm shares, and how any algorithm's configuration is read.

`TrainConfig` is composed of small option groups (`ModelOptions`, `MemoryOptions`, `PeftOptions`, `RewardOptions`,
`DataOptions`, `GenerationOptions`, `OptimizationOptions`, `LoggingOptions`, `DistributedOptions`), one flat set of
TRL's names, as MaxText composes its config. Each group holds its fields (with their `--help` text), what is derived
from them, and its own `_check`; `validate()` (run by `__post_init__`) coerces every value, runs each group's check,
then the checks that span groups, and fails with one `ConfigError` naming the option and the fix. An algorithm's
config (`rloo_jax.algorithms.rloo_config`, ...) adds its own group to this base and says what differs: its name,
its TRL option table, which models it holds, its step options, its demo.

Reading, for a given config class: `from_dict` (YAML / JSON values), `parse_argv` (`--name value`), `read_yaml`, the
Python keywords of a class decorated with `takes_trl_options`; values are parsed from the annotations (`coerce`) and
TRL's own option names are decided by the class's table (`rloo_jax.trl_options`). Which class a command line names
is the command line's business (`rloo_jax.cli`).
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
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar, Literal

import yaml

from rloo_jax import outputs
from rloo_jax.data import FILE_BUILDERS, parse_tfds_name
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.mesh import _resolve_mesh_shape
from rloo_jax.numerics import MatmulPrecision
from rloo_jax.quant import QuantSpec
from rloo_jax.tpu import parse_slice
from rloo_jax.trl_options import Decision, is_trl_only, split_options

logger = logging.getLogger("rloo_jax")

REPORT_TO_CHOICES = ("none", "tensorboard", "wandb")
DEFAULT_CACHE_DIR = "~/.cache/rloo_jax"


def _opt(default: Any, group: str, help: str) -> Any:
    """A dataclass field carrying its `--help` text and help-section name."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, "group": group})
    return field(default=default, metadata={"help": help, "group": group})


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} {rule} (got {value!r}); fix --{name}")


def _at_least_one(cfg: Any, *names: str, optional: bool = False) -> None:
    """Each option `names` of `cfg` is >= 1 (or None, with `optional`)."""
    for name in names:
        value = getattr(cfg, name)
        if optional:
            _check(value is None or value >= 1, name, "must be >= 1 or None", value)
        else:
            _check(value >= 1, name, "must be >= 1", value)


def _require(value: Any, message: str) -> None:
    if not value:
        raise ConfigError(message)


def _is_size(size: str) -> bool:
    """A size huggingface_hub reads ("5GB", "500MB", "1000"), as transformers' max_shard_size."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return int(size) > 0 if str(size).isdigit() else parse_size_to_int(size) > 0
    except ValueError:
        return False


def _check_processes(num_processes: int | None, process_id: int | None) -> None:
    _check(num_processes is None or num_processes >= 1, "num_processes", "must be >= 1 or None", num_processes)
    _check(process_id is None or process_id >= 0, "process_id", "must be >= 0 or None", process_id)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ConfigError(
            f"process_id ({process_id}) must be below num_processes ({num_processes}); processes are numbered "
            "0 .. num_processes - 1"
        )


# ------------------------------------------------------------------------------------------------ option groups
@dataclass
class ModelOptions:
    """The policy's checkpoint and how its forwards compute."""

    model_name_or_path: str | None = _opt(
        None,
        "model",
        "Policy model: a local Hugging Face folder (config.json + safetensors) or a hub id. `demo` builds "
        "the built-in tiny random-init Qwen2-shaped model (no network).",
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

    @property
    def policy_path(self) -> str | None:
        """The policy's checkpoint (PPO: sft_model_path when set, as TRL's scripts)."""
        return self.model_name_or_path

    @property
    def tokenizer_path(self) -> str | None:
        """Where the tokenizer is read (the policy's folder; PPO: model_name_or_path, as TRL's scripts)."""
        return self.policy_path


@dataclass
class MemoryOptions:
    """What the programs keep in memory, and the compile-only report of what fits a TPU slice."""

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

    def _check(self) -> None:
        if self.compile_only and self.topology is None:
            raise ConfigError("compile_only needs a TPU slice to compile for: pass --topology, e.g. v5e-8 or v5p-8")
        if self.topology is not None:
            parse_slice(self.topology)  # one line listing the slice names when it is not one


@dataclass
class PeftOptions:
    """LoRA adapters on a frozen base (TRL's ModelConfig names), and QLoRA's quantized base."""

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

    @property
    def quant_spec(self) -> QuantSpec | None:
        """How the frozen base is stored (load_in_4bit / load_in_8bit; `rloo_jax.quant`), None: unquantized."""
        if self.load_in_4bit:
            return QuantSpec(self.bnb_4bit_quant_type, self.use_bnb_nested_quant)
        return QuantSpec("int8") if self.load_in_8bit else None

    def _check(self) -> None:
        _check(self.lora_r >= 1, "lora_r", "must be >= 1", self.lora_r)
        _check(self.lora_alpha > 0, "lora_alpha", "must be > 0", self.lora_alpha)
        _check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)", self.lora_dropout)
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


@dataclass
class RewardOptions:
    """The reward functions and their weights (reward models: the algorithm's options)."""

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

    @property
    def reward_sources(self) -> list[str]:
        """Every reward in scoring order: the reward models (the algorithm's: `device_reward_paths`,
        `reward_model_paths`), then reward_funcs (TRL's script order)."""
        return list(self.reward_funcs or [])

    @property
    def device_reward_paths(self) -> list[str]:
        """Reward models scored on the token ids on the device (the first `reward_sources`; PPO's); the others run
        on the host (`rloo_jax.rewards`)."""
        return []

    @property
    def reward_model_paths(self) -> list[str]:
        """Reward models scored on the host, on the decoded texts with their own tokenizers (RLOO / GRPO's
        reward_model_name_or_path)."""
        return []

    @property
    def resolved_reward_weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights else [1.0] * len(self.reward_sources)

    @property
    def resolved_soft_overlong_cache(self) -> int:
        return self.soft_overlong_cache or max(1, self.max_completion_length // 4)

    def _check(self) -> None:
        _check(self.soft_overlong_cache >= 0, "soft_overlong_cache", "must be >= 0", self.soft_overlong_cache)


@dataclass
class DataOptions:
    """The prompt dataset and how prompts are cut and padded."""

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

    @property
    def compiled_prompt_length(self) -> int:
        """The widest prompt batch the run can see (what compile-only compiles for): max_prompt_length rounded up to
        prompt_bucket. ConfigError without a max_prompt_length."""
        if self.max_prompt_length is None:
            raise ConfigError(
                "compile_only needs --max_prompt_length: the prompt width to compile for (prompts are cut to it and "
                "padded to a multiple of prompt_bucket)"
            )
        return -(-self.max_prompt_length // self.prompt_bucket) * self.prompt_bucket

    def _check(self) -> None:
        _at_least_one(self, "prompt_bucket")
        _at_least_one(self, "max_prompt_length", optional=True)
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


@dataclass
class GenerationOptions:
    """The sampler: completions per prompt, their length and the sampling filters."""

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

    @property
    def resolved_num_generations_eval(self) -> int:
        return self.num_generations_eval or self.num_generations

    def _check(self) -> None:
        if self.num_generations < self.MIN_GENERATIONS:
            raise ConfigError(
                f"num_generations must be >= 2 for a baseline within each prompt's group (got "
                f"{self.num_generations}); set --num_generations 2 or more"
            )
        _at_least_one(self, "max_completion_length")
        _at_least_one(self, "num_generations_eval", optional=True)
        _check(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]; 1.0 disables it", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be >= 0; 0 disables it", self.top_k)
        _check(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1] or None", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0; 1.0 disables it",
               self.repetition_penalty)
        _check(self.completion_bucket >= 0, "completion_bucket", "must be >= 0 (0: no bucketing)",
               self.completion_bucket)


@dataclass
class OptimizationOptions:
    """AdamW, its schedule, the batch of a micro-step and the run's length."""

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

    def _check(self) -> None:
        _at_least_one(self, "per_device_train_batch_size", "gradient_accumulation_steps", "max_consecutive_nonfinite")
        _check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "must be >= 1 (or -1 to use num_train_epochs)",
               self.max_steps)
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


@dataclass
class LoggingOptions:
    """Outputs: metrics, records, checkpoints, the export, evaluation and the compilation cache."""

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

    def _check(self) -> None:
        _at_least_one(self, "logging_steps", "save_steps", "per_device_eval_batch_size")
        _at_least_one(self, "save_total_limit", "eval_steps", optional=True)
        _check(_is_size(self.export_max_shard_size), "export_max_shard_size", "must be a size such as 5GB or 500MB",
               self.export_max_shard_size)
        _check(self.num_completions_to_print is None or self.num_completions_to_print >= 0,
               "num_completions_to_print", "must be >= 0 or None", self.num_completions_to_print)
        for sink in self.report_to:
            if sink not in REPORT_TO_CHOICES:
                raise ConfigError(f"report_to: unknown sink {sink!r}; choose from {', '.join(REPORT_TO_CHOICES)}")


@dataclass
class DistributedOptions:
    """The device mesh and the processes of a multi-process run."""

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
    def data_shards(self) -> int:
        """Devices the batch is split over (data_parallel * fsdp): TRL's number of processes, one per device."""
        data, fsdp, _ = self.mesh_shape
        return data * fsdp

    def _check(self) -> None:
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


# ------------------------------------------------------------------------------------------------ the base config
@dataclass
class TrainConfig(DistributedOptions, LoggingOptions, OptimizationOptions, GenerationOptions, DataOptions,
                  RewardOptions, PeftOptions, MemoryOptions, ModelOptions):
    """What every run needs, whatever the algorithm: the option groups above, in that order (dataclasses collect
    the bases' fields from the last base to the first). An algorithm's config subclasses it with its own group and
    sets the class attributes and hooks below; TRL's names and defaults (bf16 is off by default on CPU). Derived
    values are properties, never stored."""

    ALGORITHM: ClassVar[str] = ""
    """The algorithm's name on the command line (`python -m rloo_jax.train grpo`) and in config.yaml."""
    TRL_RELEASE: ClassVar[str] = "1.16"
    """The TRL release whose trainer this config follows (names, defaults, math)."""
    TRL_OPTIONS: ClassVar[dict[str, Decision]] = {}
    """Every option of TRL's config and script for this algorithm that is not a field here, decided
    (`rloo_jax.trl_options`); the fields' own entries mark them supported."""
    TRL_SOURCES: ClassVar[tuple[str, ...]] = ()
    """TRL's dataclasses whose fields `TRL_OPTIONS` decides (a test walks them)."""
    ALIASES: ClassVar[dict[str, tuple[str, str]]] = {}
    """Other names of fields (older TRL releases', TRL GRPO's vLLM ones): name -> (field, what the name is, for the
    note printed when it is used)."""
    NOT_OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {}
    """Options of the other algorithms this one has no use for: name -> (the value that asks for nothing, what to
    use instead). That value is dropped (a config.yaml written before the field moved still loads); another is
    refused naming the replacement."""
    MIN_GENERATIONS: ClassVar[int] = 2
    """The fewest completions per prompt the algorithm takes (2: a baseline within each group; PPO: 1)."""
    STEPS_SPAN_GENERATIONS: ClassVar[bool] = True
    """Whether an optimizer step may span two generation batches (TRL's Trainer; not TRL 1.12's PPO)."""
    DEMO: ClassVar[dict[str, Any]] = {}
    """The built-in demo run of this algorithm (`python -m rloo_jax.train <algorithm>` with no model): the options
    over the demo task (`rloo_jax.demo`)."""

    # Facts of the machine, not options: devices of all processes and the number of processes. The trainer
    # passes jax.device_count() / jax.process_count() (after starting the multi-process runtime); the batch
    # sizes and the mesh are validated against them. Kept by `replace`, never written to YAML.
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

    # ----------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every invariant once: every value coerced to its annotation and finite, each group's `_check`
        (the base groups, then the algorithm's), then the batch arithmetic that spans groups (`_check_batches`);
        raise one `ConfigError` naming the option and the fix."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], f.name))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _check(math.isfinite(value), f.name, "must be a finite number", value)
        for cls in reversed(type(self).__mro__):
            own = vars(cls).get("_check")
            if own is not None:
                own(self)
        self._check_batches()

    def _check_batches(self) -> None:
        """The generation and evaluation batches hold whole prompt groups, split evenly over the processes."""
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

    def require_sources(self, num_rewards: int | None = None) -> None:
        """What a run needs beyond valid options: a model, a dataset and at least one reward, with one weight per
        reward. `num_rewards`: the reward functions given some other way (the Python API); default: the ones
        the config names (`reward_sources`). The CLI checks this when it reads its config; the trainers once
        their arguments are in."""
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

    # ----------------------------------------------------------------------------------------- the batches
    @property
    def resolved_steps_per_generation(self) -> int:
        """Micro-batches a generation batch is cut into (TRL's default: gradient_accumulation_steps)."""
        return self.gradient_accumulation_steps

    @property
    def resolved_num_iterations(self) -> int:
        """Optimisation passes over each generation batch."""
        return 1

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
    def steps_per_generation_batch(self) -> int:
        """What one generation batch advances the step counter (max_steps, save_steps, logging_steps, the learning
        rate schedule) by: its optimizer steps (TRL's Trainer), or 1 where a step is a generation batch (TRL 1.12's
        PPO counts updates). Where steps_per_generation x num_iterations is not a multiple of
        gradient_accumulation_steps a step may span two generation batches (`rloo_jax.step.UpdatePlan`): the
        whole steps a generation batch holds, at least 1 (what the timings are divided by)."""
        return max(1, self.micro_per_generation // self.gradient_accumulation_steps)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates that share one step's learning rate: 1, or where a step is a generation batch (TRL
        1.12's PPO steps its scheduler once per PPO update), the updates of a generation batch."""
        updates = max(1, self.micro_per_generation // self.gradient_accumulation_steps)
        return max(1, updates // self.steps_per_generation_batch)

    def total_steps(self, num_prompts: int) -> int:
        """Steps of the run: max_steps, else num_train_epochs passes over `num_prompts` prompts (the partial batch
        at an epoch's end dropped)."""
        if self.max_steps > 0:
            return self.max_steps
        batches = num_prompts // self.prompts_per_generation
        # the micro-batches of the run's generation batches, gradient_accumulation_steps per optimizer step
        return int(math.ceil(self.num_train_epochs * batches)) * self.micro_per_generation \
            // self.gradient_accumulation_steps

    # ----------------------------------------------------------------------------------------- the algorithm's
    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a reference policy (RLOO / GRPO: beta > 0; PPO: always)."""
        return False

    @property
    def reference_copies_given_adapters(self) -> bool:
        """LoRA from given adapters (a PeftModel, a PEFT adapter folder): whether the reference is the base with a
        frozen copy of them (TRL 1.16's RLOO / GRPO: its "ref" adapter) rather than the base with the adapters off
        (TRL 1.12's PPO: `disable_adapter()`)."""
        return True

    @property
    def reference_sync(self) -> tuple[int, float] | None:
        """(every how many steps, alpha) when the reference moves towards the policy (TR-DPO); None: never."""
        return None

    @property
    def uses_value_model(self) -> bool:
        """Whether the run trains a value model (PPO)."""
        return False

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        """The algorithm value the step composes (`rloo_jax.algorithms`), from this config (`tokenizer`: the
        policy's, for algorithms that need its token ids)."""
        raise NotImplementedError(f"{type(self).__name__} names no algorithm; use an algorithm's config")

    def step_options(self) -> dict[str, Any]:
        """`rloo_jax.step.StepConfig` options the algorithm sets beyond the shared ones (none here)."""
        return {}

    def prepare_tokenizer(self, tokenizer: Any) -> None:
        """Make the loaded tokenizer what the algorithm needs (nothing here); ConfigError if it cannot."""

    def sampler_stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a completion: the tokenizer's EOS and generation_config.json's (`eos_ids`)."""
        return eos_ids

    def report_settings(self) -> dict[str, Any]:
        """The algorithm's own settings in a compile-only report (beside the shared ones)."""
        return {}

    def memory_tips(self) -> list[str]:
        """The algorithm's own options that bring a program's memory down (compile-only advice)."""
        return []

    # ----------------------------------------------------------------------------------------- reading, writing
    def __getattr__(self, name: str) -> Any:
        """TRL's options given to this config without a field here (see `_keep_trl_only`)."""
        kept = self.__dict__.get("_trl_options", {})
        if name in kept:
            return kept[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def replace(self, **changes: Any) -> "TrainConfig":
        """`dataclasses.replace` that keeps the TRL options this config holds without fields (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready values (tuples become lists), the algorithm's name first."""
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"algorithm": self.ALGORITHM, **values}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def takes_trl_options(cls: type[TrainConfig]) -> type[TrainConfig]:
    """A config class whose Python keywords also take TRL's option names (`RLOOConfig(use_vllm=False,
    push_to_hub=False, ...)`), decided by its `TRL_OPTIONS` as the YAML and the command line are, so a TRL script's
    config line runs here; a misspelt name gets the command line's "did you mean" error. Without device_count, the
    batch sizes and mesh are checked for the devices and processes JAX sees (with several processes, call
    `jax.distributed.initialize()` first)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        if "device_count" not in kwargs:  # built in Python: checked for the devices JAX sees (TRL: its processes)
            import jax

            kwargs.update(device_count=jax.device_count(), process_count=jax.process_count())
        machine = {k: kwargs.pop(k) for k in ("device_count", "process_count")}
        kwargs = {canonical_name(k, f"{cls.__name__}(...)", cls): v for k, v in kwargs.items()}
        ours, checks = split_options(_drop_not_options(kwargs, cls), _hints(cls), cls.TRL_OPTIONS)
        init(self, *args, **ours, **machine)
        for check in checks:
            check(self)
        _keep_trl_only(self, kwargs)

    cls.__init__ = __init__
    return cls


def _keep_trl_only(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """The TRL options `cfg` took that are no field of it (accepted without effect, translated, or refused at their
    off value) stay readable as attributes, as on TRL's config (`cfg.push_to_hub`, `cfg.use_vllm`)."""
    table = type(cfg).TRL_OPTIONS
    kept = {k: v for k, v in values.items() if k in table and k not in {f.name for f in dataclasses.fields(cfg)}}
    object.__setattr__(cfg, "_trl_options", {**getattr(cfg, "_trl_options", {}), **kept})


def _drop_not_options(values: dict[str, Any], cls: type[TrainConfig]) -> dict[str, Any]:
    """`values` without the other algorithms' options `cls` has no use for (`NOT_OPTIONS`) at the value that asks for
    nothing; ConfigError naming the replacement for any other value."""
    out = {}
    for name, value in values.items():
        if name not in cls.NOT_OPTIONS:
            out[name] = value
            continue
        off, instead = cls.NOT_OPTIONS[name]
        parsed = coerce(value, type(off) if off is not None else str | None, name) if value is not None else None
        if parsed != off:
            raise ConfigError(f"{name} is not a {cls.ALGORITHM.upper()} option ({instead}); drop --{name}")
    return out


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """`dataclasses.replace` that keeps the TRL options `cfg` holds without fields (`_keep_trl_only`)."""
    new = dataclasses.replace(cfg, **changes)
    object.__setattr__(new, "_trl_options", dict(getattr(cfg, "_trl_options", {})))
    return new


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type[TrainConfig]) -> dict[str, Any]:
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
def field_names(cls: type[TrainConfig]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _configs() -> list[type[TrainConfig]]:
    """Every algorithm's config class defined so far (subclasses of TrainConfig with a name)."""
    found, todo = [], [TrainConfig]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.ALGORITHM:
            found.append(cls)
    return found


def canonical_name(name: str, source: str, cls: type[TrainConfig]) -> str:
    """Map an option name (or an older name of one, `cls.ALIASES`) to a field name of `cls`, a TRL option its table
    decides or another algorithm's option it drops (`NOT_OPTIONS`), or fail suggesting the nearest one."""
    name = name.replace("-", "_")
    table, fields = cls.TRL_OPTIONS, field_names(cls)
    if name in fields or name in table or name in cls.NOT_OPTIONS:  # ours, or one of TRL's (decided in its table)
        return name
    if name in cls.ALIASES:
        new, what = cls.ALIASES[name]
        logger.warning("note: `%s` is %s; using %s", name, what, new)
        return new
    near = difflib.get_close_matches(name, fields + list(cls.ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean --{near[0]}?" if near else "; see --help for the list"
    other = [c.__name__ for c in _configs() if c is not cls and name in field_names(c)]
    if other:
        hint = f" ({name} is an option of {other[0]}, not of {cls.__name__}){hint}"
    raise ConfigError(f"unknown option {name!r} in {source}{hint}")


def load_yaml(path: str) -> dict[str, Any]:
    """A YAML config file (safe loader) as a mapping; ConfigError naming the file when it is not one."""
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


def read_yaml(path: str, cls: type[TrainConfig]) -> dict[str, Any]:
    """Read a YAML config file (safe loader) into {field_name: raw value} (its `algorithm` key aside)."""
    data = load_yaml(path)
    return {canonical_name(str(k), path, cls): v for k, v in data.items() if k != "algorithm"}


def parse_argv(argv: Sequence[str], cls: type[TrainConfig]) -> tuple[str | None, dict[str, Any]]:
    """Split argv (without the algorithm word) into (the --config path, {field_name: raw string value}).

    Accepts `--name value` and `--name=value`; a bare boolean `--flag` means true.
    """
    config_path, overrides, i = None, {}, 0
    hints, table = _hints(cls), cls.TRL_OPTIONS
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --name value or --name=value (the "
                              f"algorithm, one of {', '.join(c.ALGORITHM for c in _configs())}, comes first)")
        key, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            name = key.replace("-", "_")
            if name not in hints and name not in table:
                name = cls.ALIASES.get(name, (name,))[0]
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


def from_dict(values: dict[str, Any], cls: type[TrainConfig], device_count: int = 1, process_count: int = 1
              ) -> TrainConfig:
    """A validated `cls` from {name: raw value} (its `algorithm` key aside): TRL's options decided by its table,
    values coerced to the annotated types, the sources a run needs checked (`require_sources`)."""
    values = {k: v for k, v in values.items() if k != "algorithm"}
    hints = _hints(cls)
    parsed = {canonical_name(k, "the config", cls): v for k, v in values.items()}
    parsed = _drop_not_options(parsed, cls)
    parsed, checks = split_options(parsed, hints, cls.TRL_OPTIONS)  # TRL's: refused, dropped with a note, translated
    parsed = {k: coerce(v, hints[k], k) for k, v in parsed.items()}
    trl_only = {k: v for k, v in values.items() if k in cls.TRL_OPTIONS and k not in hints}
    cfg = cls(**parsed, device_count=device_count, process_count=process_count)
    for check in checks:
        check(cfg)
    _keep_trl_only(cfg, trl_only)
    cfg.require_sources()
    return cfg


_BASE_GROUPS = ("model", "memory", "peft", "rewards", "data", "generation", "algorithm", "optimization", "logging",
                "distributed")


def format_help(cls: type[TrainConfig]) -> str:
    """`--help` text: usage, then every option of `cls` grouped (an algorithm's own sections after `algorithm`),
    with its type, default and help text."""
    name, release = cls.ALGORITHM.upper(), cls.TRL_RELEASE
    aliases = f"Other names are accepted: {', '.join(f'{k} -> {v}' for k, (v, _) in cls.ALIASES.items())} " \
        "(older TRL releases', TRL GRPO's vllm_importance_sampling_*). " if cls.ALIASES else ""
    lines = [
        f"usage: python -m rloo_jax.train [{'|'.join(c.ALGORITHM for c in _configs())}] [--config FILE.yaml] "
        "[--name value | --name=value ...]",
        "",
        f"Train a causal LM with {name} (TRL {release}'s {name} trainer math) in JAX; the first word picks the "
        "algorithm "
        "(rloo by default, or the config file's `algorithm:`), e.g. `python -m rloo_jax.train grpo --help`. Options "
        "are read from the YAML file first, then from the command line. With neither --config nor "
        "--model_name_or_path, the built-in demo (configs/default.yaml: a tiny model on a synthetic task, no "
        "network) runs.",
        f"{aliases}Every other option of TRL {release}'s {cls.__name__} and `trl {cls.ALGORITHM}` script is read "
        "without effect (named in a note) or refused with the reason (docs/trl_options.md).",
    ]
    hints = _hints(cls)
    after = _BASE_GROUPS.index("algorithm") + 0.5  # the algorithm's own sections

    def order(f: dataclasses.Field) -> float:
        group = f.metadata["group"]
        return _BASE_GROUPS.index(group) if group in _BASE_GROUPS else after

    group = None
    for f in sorted(dataclasses.fields(cls), key=order):
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


# ------------------------------------------------------------------------------------------------ local paths
PATH_OPTIONS = ("model_name_or_path", "reward_model_name_or_path", "dataset_name", "dataset_train_split",
                "dataset_test_split", "tfds_data_dir", "output_dir")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict (`TrainConfig.to_dict()`, or a config.yaml's) with every local path it names absolute (~
    expanded), as config.yaml and checkpoints record them, so a resume or `python -m rloo_jax.export` from another
    folder finds them: model_name_or_path, reward_model_name_or_path, dataset_name, dataset_train_split /
    dataset_test_split when they are data files, tfds_data_dir and a local output_dir (`PATH_OPTIONS`). "demo", hub
    ids, `tfds:` names, URLs and paths that do not exist (the run fails on them first) stay as given.
    E.g. {"model_name_or_path": "./m"} run from /home/u -> {"model_name_or_path": "/home/u/m"}."""

    def absolute(name: Any, local: Callable[[str], bool] = outputs.is_local_path) -> Any:
        if not isinstance(name, str) or not name or name == "demo" or name.startswith("tfds:") or \
                outputs.is_remote(name) or not local(name):
            return name
        path = os.path.expanduser(name)
        return os.path.abspath(path) if os.path.exists(path) else name

    def data_file(name: str) -> bool:
        return os.path.splitext(name)[1] in FILE_BUILDERS

    out = dict(values)
    for key in ("model_name_or_path", "dataset_name"):
        out[key] = absolute(values.get(key))
    if isinstance(values.get("reward_model_name_or_path"), list):
        out["reward_model_name_or_path"] = [absolute(m) for m in values["reward_model_name_or_path"]]
    for key in ("dataset_train_split", "dataset_test_split"):
        out[key] = absolute(values.get(key), data_file)
    for key in ("tfds_data_dir", "output_dir"):
        out[key] = absolute(values.get(key), lambda _: True)
    return {k: v for k, v in out.items() if k in values}


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its local paths absolute (`absolute_paths`)."""
    paths = absolute_paths(cfg.to_dict())
    return replace(cfg, **{k: paths[k] for k in PATH_OPTIONS if k in paths})

