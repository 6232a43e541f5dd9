"""Everything a run is built from its config: tokenizer, policy (and its memory options), frozen reference, data,
reward functions, optimizer and the step's static options.

`prepare(cfg)` loads a real run; `prepare(cfg, abstract=True)` builds the same run from `config.json` and the
tokenizer alone (parameters as shapes, no dataset), which is what `--compile_only` compiles (`rloo_jax.aot`).
Both go through the same functions, so the compiled programs are the ones training runs.
"""

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax import demo, outputs
from rloo_jax.config import TrainConfig
from rloo_jax.data import PromptEncoder, load_prompt_dataset
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.mesh import _resolve_mesh_shape, host_memory, rollout_shape
from rloo_jax.metrics import check_report_to
from rloo_jax.models import ModelLoadError, abstract_model, attention, load_causal_lm, load_tokenizer, lora_spec
from rloo_jax.models.hf import adapter_base, resolve_checkpoint
from rloo_jax.models.lora import quantize_base, split_adapters, with_adapters
from rloo_jax.numerics import resolved_settings
from rloo_jax.rewards import (
    RewardFunction,
    builtin_rewards,
    load_reward_model_scorer,
    resolve_reward_funcs,
    warn_missing_extras,
)
from rloo_jax.sampling import SamplingConfig, compute_dtype_weights
from rloo_jax.step import StepConfig

logger = logging.getLogger("rloo_jax")


# ------------------------------------------------------------------------------------------------ models
def model_options(cfg: TrainConfig, platform: str) -> dict[str, Any]:
    """The policy's dtypes and execution options (`ModelConfig` fields) from the run config, for the platform
    the programs run on ("cpu", "gpu", "tpu"): `bf16`, `scan_layers` and `gradient_checkpointing` None mean on
    for accelerators, off on the CPU (where they cost time and memory is not the limit; BENCHMARKS.md), as
    `rloo_jax.numerics.resolved_settings` decides, and `attn_implementation` None the best the platform offers
    (ConfigError for one it does not offer). With `use_peft` these are the base's options; `policy` adds the
    adapters."""
    settings = resolved_settings(cfg, platform)
    dtype = "bfloat16" if settings["bf16"] else "float32"
    try:
        attn = attention.resolve(settings["attn_implementation"], platform, dtype)
    except ValueError as e:
        raise ConfigError(f"{e}; fix --attn_implementation") from None
    return {
        "dtype": dtype,
        # LoRA: the base is never trained, so it is read straight into the compute dtype (as TRL + peft load it);
        # param_dtype is then the adapters' storage
        "param_dtype": dtype if cfg.use_peft else cfg.param_dtype,
        "scan_layers": settings["scan_layers"],
        "remat_policy": cfg.remat_policy if settings["gradient_checkpointing"] else "none",
        "attn_implementation": attn,
    }


@dataclasses.dataclass
class Policy:
    """The pieces of the train state (what `Programs(graphdef, ..., ref_graphdef=)` and its `init_state(params,
    ref_params, frozen)` / `abstract_state` take)."""

    graphdef: nnx.GraphDef
    params: nnx.State  # trained: the whole policy, or with LoRA its adapters only
    # the frozen reference copy (beta > 0, PPO): of the whole policy, or with LoRA from given adapters (a PEFT
    # adapter folder, a PeftModel) a copy of those adapters, TRL's "ref" adapter; None otherwise
    ref_params: nnx.State | None
    frozen: nnx.State | None = None  # LoRA: the base, in the compute dtype or quantized (QLoRA)
    ref_graphdef: nnx.GraphDef | None = None  # LoRA: the model without its adapters (the reference of new adapters)


def policy(cfg: TrainConfig, model: Any, adapter_dir: str | None = None) -> Policy:
    """The policy to train from the loaded (or abstract) model: the whole model and a reference copy, or with
    `use_peft` adapters on a frozen base (loaded in the compute dtype by `prepare`); with `load_in_4bit` /
    `load_in_8bit` that base is quantized first (`rloo_jax.models.lora.quantize_base`). `adapter_dir`: the policy is a
    PEFT adapter folder on `model`: its adapters are the starting ones (use_peft on, its LoRA options the run's:
    `check_adapter_options`).

    The reference with LoRA is TRL's: new adapters (B = 0) start as the base, whose forward with the adapters off
    is the reference (no copy); given adapters start elsewhere, and TRL 1.16's RLOO / GRPO copy them into a frozen
    "ref" adapter, the reference here too (`cfg.reference_copies_given_adapters`; TRL 1.12's PPO disables them)."""
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))
    if adapter_dir is not None:
        check_adapter_options(cfg, model.config.family, adapter_dir)
    if not cfg.use_peft:
        graphdef, params = nnx.split(model)
        ref = None
        if cfg.uses_reference:
            ref = jax.eval_shape(lambda p: reference_params(graphdef, p), params) if abstract else \
                reference_params(graphdef, params)
        return Policy(graphdef, params, ref)
    spec = lora_spec(model.config.family, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                     cfg.use_rslora)
    if cfg.quant_spec is not None:  # QLoRA: the base's block projections quantized once, here
        model = quantize_base(model, cfg.quant_spec)
    ref_graphdef, base = nnx.split(model)
    # the adapters' A from the run's seed (its own stream: sampling uses key(seed), evaluation key(seed + 1))
    lora_model = with_adapters(model, spec, jax.random.key(cfg.seed + 2), cfg.param_dtype)
    if adapter_dir is not None:  # the folder's adapters, read into param_dtype
        from rloo_jax.models.hf import ADAPTER_WEIGHTS, TensorReader, fill_adapters

        lora_model = fill_adapters(lora_model, TensorReader(Path(adapter_dir)), os.path.join(adapter_dir,
                                                                                            ADAPTER_WEIGHTS))
    graphdef, adapters, _ = split_adapters(lora_model)
    ref = None
    if adapter_dir is not None and cfg.uses_reference and cfg.reference_copies_given_adapters:
        ref = adapters if abstract else jax.tree.map(jnp.copy, adapters)  # a copy: update() donates the adapters
    return Policy(graphdef, adapters, ref, base, ref_graphdef)


def check_adapter_options(cfg: TrainConfig, family: str, adapter_dir: str) -> None:
    """A PEFT adapter folder as the policy trains its adapters: use_peft on, and lora_r, lora_alpha, use_rslora and
    lora_target_modules those of its adapter_config.json (lora_dropout is the run's: it changes no weight);
    ConfigError naming the differences otherwise. The Python API sets them from the folder."""
    from rloo_jax.models.loaded import adapter_lora_options

    theirs = adapter_lora_options(adapter_dir)
    if not cfg.use_peft:
        raise ConfigError(f"model_name_or_path {adapter_dir} is a PEFT adapter folder: set use_peft (with its "
                          f"LoRA options: {', '.join(f'{k}={v}' for k, v in theirs.items() if k != 'use_peft')})")
    ours = lora_spec(family, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules, cfg.use_rslora)
    want = lora_spec(family, theirs["lora_r"], theirs["lora_alpha"], 0.0, theirs["lora_target_modules"],
                     theirs["use_rslora"])
    if ours != want:
        raise ConfigError(f"the adapter folder {adapter_dir} holds LoRA r={want.rank}, alpha={want.alpha}, "
                          f"targets={list(want.targets)}, use_rslora={want.use_rslora}; the run asks for "
                          f"r={ours.rank}, alpha={ours.alpha}, targets={list(ours.targets)}, "
                          f"use_rslora={ours.use_rslora}: set lora_r / lora_alpha / lora_target_modules / "
                          "use_rslora to the folder's")


def reference_params(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
    """The frozen reference: a copy of the initial policy with its matrices in the compute dtype (bf16 runs store
    half); norms and biases keep their dtype. The policy casts its matrices to the compute dtype on every use, so
    at step 0 both compute with the same numbers."""
    return jax.tree.map(jnp.copy, compute_dtype_weights(graphdef, params))  # a copy: update() donates the policy


def eos_token_ids(model_dir: str, tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS plus every id in the model's generation_config.json (Qwen/Llama-3 have several)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            extra = json.load(f).get("eos_token_id")
        ids += [int(e) for e in (extra if isinstance(extra, list) else [extra]) if e is not None]
    return tuple(dict.fromkeys(ids))


def refuse_custom_code(model_dir: str) -> None:
    """A tokenizer that only loads through code shipped with the model (`auto_map` in tokenizer_config.json
    and no tokenizer.json) is refused before transformers could offer to run that code."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return  # loaded as a plain PreTrainedTokenizerFast: no custom code is consulted
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # missing or unreadable: the loader reports it
    if auto_map:
        raise ModelLoadError(
            f"the tokenizer in {model_dir} needs code shipped with the model (auto_map in tokenizer_config.json); "
            "rloo_jax never runs such code, whatever trust_remote_code says: save a fast tokenizer "
            "(tokenizer.json) in that folder"
        )


# ------------------------------------------------------------------------------------------------ the run
@dataclasses.dataclass
class Run:
    """What the loop needs, all loaded and validated before anything is written (`abstract`: shapes only)."""

    cfg: TrainConfig
    tokenizer: Any
    model: Any
    train_ds: Any
    eval_ds: dict[str, Any]  # evaluation sets by name ("": the one set); empty: no evaluation
    encoder: PromptEncoder
    reward_funcs: list[RewardFunction]
    eos_ids: tuple[int, ...]
    reward_models: list[str] = dataclasses.field(default_factory=list)  # their folders (compile-only)
    model_dir: str = ""  # the policy's local folder (a LoRA adapter names it as its base unless given a hub id)
    adapter_dir: str | None = None  # the policy is this PEFT adapter folder on model_dir (its starting adapters)
    value_model: Any = None  # a RewardModel trained as the value model (PPO), loaded or abstract; else None
    device_reward_model: Any = None  # a RewardModel scored on the token ids on the device (PPO); else None
    device_reward_names: list[str] = dataclasses.field(default_factory=list)  # its name in the metrics


@dataclasses.dataclass
class Given:
    """Objects the Python API (`rloo_jax.RLOOTrainer`) passes instead of what the config names; None: load what
    the config names."""

    tokenizer: Any = None  # the policy's tokenizer (TRL's processing_class)
    train_dataset: Any = None  # datasets.Dataset with a `prompt` column
    eval_dataset: Any = None  # one set, or {name: set} (TRL's metric prefixes eval_<name>_)
    reward_funcs: list[Any] | None = None  # callables and/or reward_funcs strings, in scoring order
    reward_tokenizers: list[Any] | None = None  # one per reward_funcs entry (None: a reward model's own)
    callbacks: list[Any] | None = None  # transformers-style callbacks (rloo_jax.callbacks)


def prepare(cfg: TrainConfig, abstract: bool = False, given: Given | None = None) -> Run:
    """Resolve the demo, load tokenizer, policy, data and reward functions; check the first batch encodes.

    `abstract`: the policy and reward models as shapes from their `config.json` (no weights read), no dataset;
    Python reward functions are still imported (a wrong name fails here, as in training). `given`: objects
    that replace what the config names (the Python API).
    """
    given = given or Given()
    device_paths = cfg.device_reward_paths  # scored on the token ids on the device, ahead of the functions
    sources = cfg.reward_sources[len(device_paths):] if given.reward_funcs is None else list(given.reward_funcs)
    cfg.require_sources(len(device_paths) + len(sources))
    model_path, dataset = cfg.policy_path, cfg.dataset_name
    if model_path == "demo":
        model_path = demo.model_folder(cfg.seed)
    if dataset == "demo" and not abstract:
        dataset = demo.dataset_folder(cfg.seed)
    if cfg.trust_remote_code:
        logger.warning("note: trust_remote_code has no effect; rloo_jax never runs code shipped with a model")
    model_dir = str(resolve_checkpoint(model_path, weights=not abstract))
    adapter_dir, tokenizer_dir = None, model_dir
    base = adapter_base(model_dir)
    if base is not None:  # a PEFT adapter folder: its base is the model; its tokenizer, when it has one
        adapter_dir, model_dir = model_dir, str(resolve_checkpoint(base, weights=not abstract))
        if not any(os.path.isfile(os.path.join(adapter_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer_dir = model_dir
    refuse_custom_code(tokenizer_dir)
    if cfg.tokenizer_path not in (None, cfg.policy_path):  # PPO: TRL's scripts read it from model_name_or_path
        tokenizer_dir = str(resolve_checkpoint(cfg.tokenizer_path, weights=False))
        refuse_custom_code(tokenizer_dir)
    reward_models = [str(resolve_checkpoint(p, weights=not abstract)) for p in cfg.reward_model_paths]
    for reward_model in reward_models:
        refuse_custom_code(reward_model)
    tokenizer = load_tokenizer(tokenizer_dir, padding_side="left") if given.tokenizer is None else \
        given_tokenizer(given.tokenizer)
    cfg.prepare_tokenizer(tokenizer)
    options = model_options(cfg, "tpu" if abstract else jax.default_backend())
    if abstract:
        model = abstract_model(model_dir, **options)
    else:
        # on a mesh the weights wait in host memory until the train state shards them (a whole 8B model in bf16
        # does not fit one 16 GB chip); on one device they load there directly
        with host_memory() if cfg.device_count > 1 else contextlib.nullcontext():
            model = load_causal_lm(model_dir, **options)
    encoder = PromptEncoder(tokenizer, cfg.max_prompt_length, cfg.prompt_bucket, cfg.chat_template_kwargs)
    train_ds, eval_ds = None, {}
    if not abstract:
        train_ds = given.train_dataset
        if given.eval_dataset is not None:
            eval_ds = dict(given.eval_dataset) if isinstance(given.eval_dataset, dict) else {"": given.eval_dataset}
        where = {"config": cfg.dataset_config, "tfds_data_dir": cfg.tfds_data_dir}
        if train_ds is None:
            dataset = local_dataset(dataset)
            train_ds = load_prompt_dataset(dataset, cfg.dataset_train_split, **where)
        if cfg.eval_steps and not eval_ds:
            eval_ds = {"": load_prompt_dataset(local_dataset(dataset), cfg.dataset_test_split, **where)}
        encoder(train_ds[:1])  # fails early on a missing chat template or an empty prompt
    builtins = builtin_rewards(cfg.format_reward_pattern, cfg.max_completion_length, cfg.resolved_soft_overlong_cache)
    reward_tokenizers = {s: t for s, t in zip(sources, given.reward_tokenizers or [], strict=False)
                         if isinstance(s, str) and t is not None}
    reward_funcs = resolve_reward_funcs(
        sources,
        builtins,
        lambda path: load_reward_model_scorer(
            path, options["dtype"], cfg.prompt_bucket, cfg.chat_template_kwargs, tokenizer=reward_tokenizers.get(path),
            attn_implementation=options["attn_implementation"],
        )
        if not abstract
        else (lambda **kwargs: None),  # compiled, never called, in compile-only mode
    )
    if not abstract:
        warn_missing_extras(reward_funcs)
    check_report_to(cfg.report_to)
    eos = eos_token_ids(model_dir, tokenizer)
    if not eos:
        raise ConfigError(f"the tokenizer of {model_path} has no eos_token; completions could never end")
    run = Run(cfg, tokenizer, model, train_ds, eval_ds, encoder, reward_funcs, cfg.sampler_stop_ids(tokenizer, eos),
              reward_models, model_dir, adapter_dir)
    if cfg.uses_value_model or device_paths:
        value_and_reward_models(run, device_paths, options, abstract)
    return run


def value_and_reward_models(run: Run, device_paths: list[str], options: dict[str, Any], abstract: bool) -> None:
    """The value model (`cfg.resolved_value_model_path`: a sequence-classification checkpoint, or a causal LM's
    backbone with a new score head) and the reward models scored on the device (`device_paths`), each checked to
    share the policy's tokenizer; abstract for compile-only. The value model is trained: stored in param_dtype; a
    reward model is frozen: stored in the compute dtype (as the reference)."""
    from rloo_jax.models import abstract_value_model, load_reward_model, load_value_model

    cfg = run.cfg
    pad = run.tokenizer.pad_token_id
    if pad is None or not 0 <= int(pad) < run.model.config.vocab_size:
        raise ConfigError(f"the pad token id {pad} is outside the policy's vocabulary ({run.model.config.vocab_size} "
                          "embeddings); pick a pad_token the models embed")
    kinds = {"dtype": options["dtype"], "scan_layers": options["scan_layers"],
             "remat_policy": options["remat_policy"], "attn_implementation": options["attn_implementation"]}
    where = host_memory() if cfg.device_count > 1 else contextlib.nullcontext()
    if cfg.uses_value_model:
        path = cfg.resolved_value_model_path
        if path == "demo":  # the demo policy's folder: its backbone with a new score head
            path = demo.model_folder(cfg.seed)
        folder = str(resolve_checkpoint(path, weights=not abstract))
        check_same_tokenizer(run, folder, "value model")
        if abstract:
            run.value_model = abstract_value_model(folder, param_dtype=cfg.param_dtype, **kinds)
        else:
            with where:
                run.value_model = load_value_model(folder, param_dtype=cfg.param_dtype, seed=cfg.seed + 3, **kinds)
    for path in device_paths:
        folder = str(resolve_checkpoint(path, weights=not abstract))
        check_same_tokenizer(run, folder, "reward model")
        run.device_reward_names.append(os.path.basename(os.path.normpath(str(path))) or "reward_model")
        if abstract:
            run.device_reward_model = abstract_model(folder, "reward", param_dtype=options["dtype"], **kinds)
        else:
            with where:
                run.device_reward_model = load_reward_model(folder, param_dtype=options["dtype"], **kinds)


def check_same_tokenizer(run: Run, folder: str, what: str) -> None:
    """A model that reads the policy's token ids must embed the same vocabulary: its config's vocab_size equals
    the policy's, and a tokenizer shipped in its folder has the policy tokenizer's vocabulary (added tokens such as
    a pad token aside). `ModelLoadError` otherwise."""
    from rloo_jax.models.hf import read_hf_config

    theirs = int(read_hf_config(Path(folder)).get("vocab_size", -1))
    ours = run.model.config.vocab_size
    if theirs != ours:
        raise ModelLoadError(
            f"the {what} at {folder} has another vocabulary than the policy ({theirs} against {ours} token "
            "embeddings): PPO scores the policy's token ids with it, as TRL does; use a model of the policy's "
            "tokenizer"
        )
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        other = load_tokenizer(folder)
    except ModelLoadError:
        return  # no usable tokenizer in the folder: the vocabulary size is all there is to check
    if base_vocab(other) != base_vocab(run.tokenizer):
        raise ModelLoadError(
            f"the {what} at {folder} comes with another tokenizer than the policy's: PPO scores the policy's token "
            "ids with it, as TRL does; use a model trained on the policy's tokenizer"
        )


def base_vocab(tokenizer: Any) -> dict[str, int]:
    """A tokenizer's vocabulary without its added tokens (a pad token added by a script aside)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=False)
    added = set(getattr(tokenizer, "get_added_vocab", dict)())
    return {k: v for k, v in tokenizer.get_vocab().items() if k not in added}


def local_dataset(name: str) -> str:
    """A dataset source as `load_prompt_dataset` takes it: a local path (`rloo_jax.outputs.is_local_path`) with ~
    expanded, DataError when it does not exist (never a hub download); a hub id or `tfds:` name as given."""
    if name.startswith("tfds:") or not outputs.is_local_path(name):
        return name
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise DataError(f"dataset {name}: no such file or folder ({os.path.abspath(path)}; a hub dataset id is "
                        "`name` or `namespace/name`)")
    return path


def given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer passed in (TRL's processing_class) made ready as `load_tokenizer` makes its own: left padding
    and a pad token (eos when it has none, as TRL)."""
    if not hasattr(tokenizer, "apply_chat_template") or not hasattr(tokenizer, "batch_decode"):
        raise ConfigError(f"processing_class must be a transformers tokenizer (got {type(tokenizer).__name__}); "
                          "processors of multimodal models are not supported")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError("processing_class has neither a pad nor an eos token; set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


ROLLOUT_COPY_FRACTION = 0.25  # of a device's memory: the most the sampler's share of the weights may take by default


def device_memory_bytes() -> int | None:
    """The memory of this process's first device (TPU/GPU `memory_stats()["bytes_limit"]`); None on CPU."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def rollout_mesh_shape(cfg: TrainConfig, run: Run, device_bytes: int | None = None) -> tuple[int, int, int]:
    """`rollout_mesh` resolved to (data, fsdp, tensor) sizes. None: `rloo_jax.mesh.rollout_shape` (whole weights on
    every device where one compute-dtype copy of the policy takes at most ROLLOUT_COPY_FRACTION of `device_bytes`,
    this process's device by default, the compile-only slice's chip; else tensor-parallel as far as the heads
    allow where that share fits; else the training mesh). Every process decides alike (same devices)."""
    if cfg.rollout_mesh is not None:
        sizes = dict(zip(("data", "fsdp", "tensor"), cfg.rollout_mesh, strict=True))
        return _resolve_mesh_shape(sizes, cfg.device_count)
    device_bytes = device_memory_bytes() if device_bytes is None else device_bytes
    config = run.model.config
    params = sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param)))
    bf16 = cfg.bf16 if cfg.bf16 is not None else config.dtype == "bfloat16"  # None: as the model loaded
    copy = params * (2 if bf16 else 4)
    return rollout_shape(cfg.mesh_shape, copy, device_bytes, config.num_heads, config.num_kv_heads,
                         ROLLOUT_COPY_FRACTION)


def sampling_config(cfg: TrainConfig, run: Run, num_generations: int) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=cfg.max_completion_length,
        num_generations=num_generations,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        eos_token_ids=run.eos_ids,
        pad_token_id=int(run.tokenizer.pad_token_id),
    )


def step_config(cfg: TrainConfig, run: Run) -> StepConfig:
    """The step's static options: the sampler's, the algorithm the config names (`make_algorithm`), the batching
    and the algorithm's own (`cfg.step_options()`: where the old log-probs come from, the sampler/trainer
    correction, PPO's log-prob temperature and row order)."""
    return StepConfig(
        sampling=sampling_config(cfg, run, cfg.num_generations),
        algorithm=cfg.make_algorithm(run.tokenizer),
        num_iterations=cfg.resolved_num_iterations,
        steps_per_generation=cfg.resolved_steps_per_generation,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        dropout_seed=cfg.seed if cfg.use_peft and cfg.lora_dropout > 0 else None,
        **cfg.step_options(),
    )
