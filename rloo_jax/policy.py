"""The policy a run trains, from the loaded (or abstract) model: its trained parameters, the reference the KL is
taken to, and with LoRA the frozen base (quantized for QLoRA) and the starting adapters."""

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax.errors import ConfigError
from rloo_jax.models import lora_spec
from rloo_jax.models.lora import quantize_base, split_adapters, with_adapters
from rloo_jax.sampling import compute_dtype_weights


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


def policy(cfg: Any, model: Any, adapter_dir: str | None = None) -> Policy:
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
            ref = (jax.eval_shape(lambda p: reference_params(graphdef, p), params) if abstract
                   else reference_params(graphdef, params))
        return Policy(graphdef, params, ref)
    spec = lora_spec(model.config.family, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                     cfg.use_rslora, cfg.lora_target_parameters)
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


def check_adapter_options(cfg: Any, family: str, adapter_dir: str) -> None:
    """A PEFT adapter folder as the policy trains its adapters: use_peft on, and lora_r, lora_alpha, use_rslora and
    lora_target_modules / lora_target_parameters those of its adapter_config.json (lora_dropout is the run's: it
    changes no weight); ConfigError naming the differences otherwise. The Python API sets them from the folder."""
    from rloo_jax.models.loaded import adapter_lora_options

    theirs = adapter_lora_options(adapter_dir)
    if not cfg.use_peft:
        raise ConfigError(f"model_name_or_path {adapter_dir} is a PEFT adapter folder: set use_peft (with its "
                          f"LoRA options: {', '.join(f'{k}={v}' for k, v in theirs.items() if k != 'use_peft')})")
    ours = lora_spec(family, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules, cfg.use_rslora,
                     cfg.lora_target_parameters)
    want = lora_spec(family, theirs["lora_r"], theirs["lora_alpha"], 0.0, theirs["lora_target_modules"],
                     theirs["use_rslora"], theirs["lora_target_parameters"])
    if ours != want:
        raise ConfigError(f"the adapter folder {adapter_dir} holds LoRA r={want.rank}, alpha={want.alpha}, "
                          f"targets={list(want.targets)}, target_parameters={list(want.target_parameters)}, "
                          f"use_rslora={want.use_rslora}; the run asks for "
                          f"r={ours.rank}, alpha={ours.alpha}, targets={list(ours.targets)}, "
                          f"target_parameters={list(ours.target_parameters)}, "
                          f"use_rslora={ours.use_rslora}: set lora_r / lora_alpha / lora_target_modules / "
                          "lora_target_parameters / use_rslora to the folder's")


def reference_params(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
    """The frozen reference: a copy of the initial policy with its matrices in the compute dtype (bf16 runs store
    half); norms and biases keep their dtype. The policy casts its matrices to the compute dtype on every use, so
    at step 0 both compute with the same numbers."""
    return jax.tree.map(jnp.copy, compute_dtype_weights(graphdef, params))  # a copy: update() donates the policy
