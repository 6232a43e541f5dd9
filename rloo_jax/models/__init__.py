"""Flax NNX causal LMs (Llama/Qwen2/Mistral, GPT-NeoX) and reward heads, with Hugging Face checkpoint I/O."""

from rloo_jax.models.config import ModelConfig, ModelLoadError, config_from_hf, config_to_hf, rope_inv_freq
from rloo_jax.models.hf import (
    abstract_model,
    export_tensors,
    init_causal_lm,
    init_reward_model,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    save_pretrained,
    weight_table,
)
from rloo_jax.models.transformer import (
    CausalLM,
    DecodeCache,
    PromptCache,
    RewardModel,
    last_token_index,
    logical_axes,
    positions_from_mask,
)

__all__ = [
    "CausalLM",
    "DecodeCache",
    "ModelConfig",
    "ModelLoadError",
    "PromptCache",
    "RewardModel",
    "abstract_model",
    "config_from_hf",
    "config_to_hf",
    "export_tensors",
    "init_causal_lm",
    "init_reward_model",
    "last_token_index",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "logical_axes",
    "positions_from_mask",
    "rope_inv_freq",
    "save_pretrained",
    "weight_table",
]
