"""The option groups every run configuration is composed of, each its fields (TRL's names and defaults, with their
`--help` text), what is derived from them and its own `_check`: `ModelOptions`, `MemoryOptions`, `PeftOptions`,
`RewardOptions`, `DataOptions`, `GenerationOptions`, `OptimizationOptions`, `LoggingOptions`, `DistributedOptions`.
`rloo_jax.config.TrainConfig` composes them (as MaxText composes its config); an algorithm's config adds its own
group (`rloo_jax.algorithms.<name>_config`)."""

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from rloo_jax.data import parse_tfds_name
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.mesh import _resolve_mesh_shape
from rloo_jax.numerics import MatmulPrecision
from rloo_jax.quant import QuantSpec
from rloo_jax.tpu import parse_slice

REPORT_TO_CHOICES = ("none", "tensorboard", "wandb")
DEFAULT_CACHE_DIR = os.environ.get("RLOO_JAX_CACHE", "~/.cache/rloo_jax")  # as demo.CACHE_ROOT


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


def _check_interval(cfg: Any, name: str) -> None:
    """`name` (logging_steps, save_steps, eval_steps) is transformers' interval: an integer >= 1 (steps) or a float
    in (0, 1) (a ratio of the run's steps); eval_steps may be None."""
    value = getattr(cfg, name)
    if value is None and name == "eval_steps":
        return
    ok = isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value < 1
    _check(ok, name, "must be an integer >= 1 (steps) or a float in (0, 1) (a ratio of the run's steps)" +
           (" or None" if name == "eval_steps" else ""), value)


def resolve_interval(value: int | float | None, total_steps: int) -> int | None:
    """A logging / eval / save interval in steps: a ratio in (0, 1) of `total_steps` as transformers'
    `TrainerState.compute_steps` rounds it (`math.ceil(max_steps * ratio)`), an integer as given. 0.1 of 25 -> 3."""
    if value is None or value >= 1:
        return value if value is None else int(value)
    return math.ceil(total_steps * value)


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


def check_processes(num_processes: int | None, process_id: int | None) -> None:
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
    moe_implementation: Literal["ragged_dot", "megablox"] | None = _opt(
        None,
        "model",
        "How a mixture of experts computes its experts (one grouped matmul per projection over the tokens sorted by "
        "expert): ragged_dot (jax.lax.ragged_dot; on TPU its weight gradient costs every expert for every token), "
        "megablox (jax's Pallas TPU grouped matmul: forward and gradient sparse; interpreted on CPU, slow: for "
        "tests; not on GPU). None: megablox on TPU (and --compile_only), ragged_dot otherwise (docs/scale.md).",
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
    lora_target_parameters: list[str] | None = _opt(
        None,
        "peft",
        "A mixture of experts' expert parameters with adapters too (TRL's name; peft's target_parameters, "
        "comma-separated): mlp.experts.gate_up_proj, mlp.experts.down_proj (Qwen3-MoE, GPT-OSS; any dotted suffix, "
        "as peft matches them). Per expert e: W_e + lora_alpha / lora_r * A_e B_e, A_e [in, r], B_e [r, out]; "
        "gate_up_proj is one adapter (one A for gate and up). Needs lora_dropout 0 (peft refuses dropout there). "
        "None: the experts have no adapters (peft's all-linear leaves them alone too).",
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
        if self.use_peft and self.lora_target_parameters and self.lora_dropout:
            raise ConfigError(f"lora_target_parameters needs lora_dropout 0 (got {self.lora_dropout}; TRL's default "
                              "is 0.05): peft's adapters on expert parameters refuse dropout; pass --lora_dropout 0")
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
    lr_scheduler_type: Literal["linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"] = _opt(
        "linear",
        "optimization",
        "The learning-rate schedule (counted in optimizer steps). cosine_with_min_lr: the cosine down to min_lr "
        "(or min_lr_rate x learning_rate) instead of 0.",
    )
    min_lr: float | None = _opt(
        None,
        "optimization",
        "cosine_with_min_lr's floor (transformers' lr_scheduler_kwargs min_lr). Set it or min_lr_rate.",
    )
    min_lr_rate: float | None = _opt(
        None,
        "optimization",
        "cosine_with_min_lr's floor as a fraction of learning_rate (transformers' lr_scheduler_kwargs min_lr_rate).",
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
        floors = [name for name in ("min_lr", "min_lr_rate") if getattr(self, name) is not None]
        if self.lr_scheduler_type == "cosine_with_min_lr" and len(floors) != 1:
            raise ConfigError("lr_scheduler_type cosine_with_min_lr needs one of min_lr or min_lr_rate (got "
                              f"{' and '.join(floors) or 'neither'}); set --min_lr or --min_lr_rate")
        if self.lr_scheduler_type != "cosine_with_min_lr" and floors:
            raise ConfigError(f"{floors[0]} is the floor of lr_scheduler_type cosine_with_min_lr, not of "
                              f"{self.lr_scheduler_type}; set --lr_scheduler_type cosine_with_min_lr or drop it")
        if self.min_lr is not None:
            _check(0 <= self.min_lr <= self.learning_rate, "min_lr", "must be in [0, learning_rate]", self.min_lr)
        if self.min_lr_rate is not None:
            _check(0 <= self.min_lr_rate <= 1, "min_lr_rate", "must be in [0, 1]", self.min_lr_rate)
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
    logging_steps: int | float = _opt(
        10,
        "logging",
        "Log metrics every this many optimizer steps; a float in (0, 1) is a ratio of the run's steps "
        "(ceil(total steps x ratio), as transformers).",
    )
    log_completions: bool = _opt(
        False,
        "logging",
        "Write every completion of a logged step to rollouts.jsonl and print them (num_completions_to_print); "
        "the last step is always written, and printed only with this set.",
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
    save_steps: int | float = _opt(
        500,
        "logging",
        "Save a checkpoint every this many optimizer steps (and at the end); a float in (0, 1) is a ratio of the "
        "run's steps (ceil(total steps x ratio), as transformers).",
    )
    save_strategy: Literal["steps", "epoch"] = _opt(
        "steps",
        "logging",
        "When checkpoints are written (transformers' option): steps (every save_steps) or epoch (at the end of "
        "each pass over the training prompts, save_steps unused); always at the end of the run too.",
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
    eval_steps: int | float | None = _opt(
        None,
        "logging",
        "Evaluate on dataset_test_split every this many optimizer steps (None: no evaluation, unless eval_strategy "
        "is epoch); a float in (0, 1) is a ratio of the run's steps (ceil(total steps x ratio), as transformers).",
    )
    eval_strategy: Literal["steps", "epoch"] = _opt(
        "steps",
        "logging",
        "When to evaluate (transformers' option): steps (every eval_steps) or epoch (at the end of each pass over "
        "the training prompts, eval_steps unused); also at the end of the run. TRL's `no` sets eval_steps None.",
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

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates: every eval_steps, or at each epoch's end (eval_strategy epoch)."""
        return self.eval_steps is not None or self.eval_strategy == "epoch"

    def _check(self) -> None:
        _at_least_one(self, "per_device_eval_batch_size")
        _at_least_one(self, "save_total_limit", optional=True)
        for name in ("logging_steps", "save_steps", "eval_steps"):
            _check_interval(self, name)
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
        "style). data_parallel * fsdp * tensor_parallel (* expert_parallel) must equal the number of devices of "
        "all processes.",
    )
    expert_parallel: int = _opt(
        1,
        "distributed",
        "Size of the mesh axis `expert` (a mixture-of-experts policy): its experts split over that many devices, "
        "each computing the (token, expert) pairs of its own experts (fsdp still splits each expert on the hidden "
        "dimension). The axis carries no batch rows: attention and the dense parts run replicated along it, as "
        "along tensor. Must divide the policy's expert count; 1 (the default): no expert axis. Not with "
        "rollout_mesh (the sampler runs on the training mesh).",
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
        if self.expert_parallel != 1:  # its own axis (`rloo_jax.mesh.make_mesh`), among the devices
            sizes["expert_parallel"] = self.expert_parallel
        try:
            data, fsdp, tensor, *_ = _resolve_mesh_shape(sizes, self.device_count)
        except ValueError as e:
            raise ConfigError(f"{e}; fix --{' / --'.join(sizes)}") from None
        return data, fsdp, tensor

    @property
    def data_shards(self) -> int:
        """Devices the batch is split over (data_parallel * fsdp): TRL's number of processes, one per device."""
        data, fsdp, _ = self.mesh_shape
        return data * fsdp

    def _check(self) -> None:
        """Mesh sizes fit the devices (raises through `mesh_shape`); explicit process options are consistent."""
        if self.expert_parallel < 1:
            raise ConfigError(f"expert_parallel must be a positive mesh size (1: no expert axis), got "
                              f"{self.expert_parallel}")
        self.mesh_shape  # noqa: B018 - resolving the mesh is the check
        if self.expert_parallel > 1 and self.rollout_mesh is not None:
            raise ConfigError(f"rollout_mesh {self.rollout_mesh} with expert_parallel {self.expert_parallel}: the "
                              "sampler runs on the training mesh with expert parallelism; leave rollout_mesh unset")
        if self.rollout_mesh is not None:
            sizes = dict(zip(("data", "fsdp", "tensor"), self.rollout_mesh, strict=True))
            try:
                _resolve_mesh_shape(sizes, self.device_count)
            except ValueError as e:
                raise ConfigError(f"rollout_mesh: {e}; give data,fsdp,tensor sizes whose product is the device count "
                                  "(one may be -1), or leave it unset") from None
        check_processes(self.num_processes, self.process_id)
