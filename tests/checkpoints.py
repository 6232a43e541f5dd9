"""Tiny offline Hugging Face checkpoints and a tokenizer, built with torch + transformers for tests.

Every builder takes a directory, writes a complete checkpoint there (`config.json` + safetensors) from a small
config with a fixed seed, and returns the directory as a `Path`. Weights are random with init std 0.15 and
randomised norm weights / biases, so logits are far from flat and a wrong weight mapping changes them.

Shared constants: `VOCAB` (model vocab size), `PAD_ID`, `EOS_ID`, `BOS_ID` (the tokenizer's special ids).
Usable from any test:

    from tests.checkpoints import build_qwen2, build_tokenizer
    path = build_qwen2(tmp_path / "qwen2", tied=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 288  # model vocab size; >= the tokenizer's 280 entries
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2  # tokenizer special tokens "<pad>", "<|endoftext|>", "<s>"
_SPECIAL = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
# The size every tiny checkpoint shares: hidden 32, 4 heads (head_dim 8), 2 layers.
TINY_SIZE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.15,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5.",
    "What is 7 times 6? The answer is 42.",
    "Reinforcement learning from human feedback trains a policy with a reward model.",
    "The leave-one-out baseline averages the rewards of the other samples.",
    "Write a short poem about the sea and the sky.",
    "Once upon a time there was a small model that learned to count.",
    "Hello, world! How are you today?",
    "JAX compiles numerical programs with XLA for CPUs, GPUs and TPUs.",
    "Please answer with a single number: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
] * 4


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + 0.2 N(0,1), every bias ~ 0.1 N(0,1): a swapped or dropped norm/bias shows up."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def _build(model_cls: type, config: Any, out_dir: str | Path, seed: int, max_shard_size: str | None = None) -> Path:
    """Instantiate `model_cls(config)` in float32 under `seed`, randomise norms/biases, save, return the dir."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    _randomise(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def qwen2_config(tied: bool = True, **overrides: Any) -> transformers.Qwen2Config:
    """Qwen2, GQA (4 heads / 2 kv heads, head_dim 8), hidden 32, 2 layers."""
    kw = dict(
        **TINY_SIZE,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        **_SPECIAL,
    )
    kw.update(overrides)
    return transformers.Qwen2Config(**kw)


def build_qwen2(out_dir: str | Path, tied: bool = True, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Qwen2ForCausalLM; tied=True writes no `lm_head.weight`."""
    return _build(transformers.Qwen2ForCausalLM, qwen2_config(tied), out_dir, seed, max_shard_size)


def build_llama3(out_dir: str | Path, seed: int = 1) -> Path:
    """LlamaForCausalLM with llama3 rope scaling (factor 8, original context 16), 4 heads / 2 kv, untied."""
    config = transformers.LlamaConfig(
        **TINY_SIZE,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **_SPECIAL,
    )
    return _build(transformers.LlamaForCausalLM, config, out_dir, seed)


def gpt_neox_config(parallel_residual: bool = True, rotary_pct: float = 0.25, **overrides: Any) -> Any:
    """GPT-NeoX (Pythia layout): hidden 32, 4 heads (head_dim 8), 2 layers, partial rotary."""
    kw = dict(
        **TINY_SIZE,
        use_parallel_residual=parallel_residual,
        rotary_pct=rotary_pct,
        rotary_emb_base=10000,
        tie_word_embeddings=False,
        **_SPECIAL,
    )
    kw.update(overrides)
    return transformers.GPTNeoXConfig(**kw)


def build_gpt_neox(
    out_dir: str | Path, parallel_residual: bool = True, rotary_pct: float = 0.25, seed: int = 2
) -> Path:
    """GPTNeoXForCausalLM (fused query_key_value, untied embed_out)."""
    config = gpt_neox_config(parallel_residual, rotary_pct)
    return _build(transformers.GPTNeoXForCausalLM, config, out_dir, seed)


def build_gpt_neox_reward(out_dir: str | Path, seed: int = 3) -> Path:
    """GPTNeoXForSequenceClassification, num_labels=1, pad_token_id=PAD_ID (rotary_pct 0.5, sequential)."""
    config = gpt_neox_config(parallel_residual=False, rotary_pct=0.5, num_labels=1)
    return _build(transformers.GPTNeoXForSequenceClassification, config, out_dir, seed)


def build_qwen2_reward(out_dir: str | Path, seed: int = 4) -> Path:
    """Qwen2ForSequenceClassification, num_labels=1, pad_token_id=PAD_ID."""
    config = qwen2_config(tied=False, num_labels=1)
    return _build(transformers.Qwen2ForSequenceClassification, config, out_dir, seed)


def build_mistral(out_dir: str | Path, sliding_window: int = 4, seed: int = 5) -> Path:
    """MistralForCausalLM with a short `sliding_window` (a key is visible iff q_pos - k_pos < window)."""
    config = transformers.MistralConfig(
        **TINY_SIZE,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        **_SPECIAL,
    )
    return _build(transformers.MistralForCausalLM, config, out_dir, seed)


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: str | Path, padding_side: str = "left") -> Path:
    """Byte-level BPE (280 entries: 3 specials, 256 bytes, merges) trained on `CORPUS`, saved as a
    `PreTrainedTokenizerFast` with pad "<pad>" (0), eos "<|endoftext|>" (1), bos "<s>" (2) and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<pad>", "<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        bos_token="<s>",
        padding_side=padding_side,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


# name -> builder(out_dir) for the session fixture in tests/fixtures_models.py
BUILDERS = {
    "qwen2_tied": lambda d: build_qwen2(d, tied=True),
    "qwen2_untied": lambda d: build_qwen2(d, tied=False),
    "llama3": build_llama3,
    "mistral_sliding": build_mistral,
    "neox_parallel_r025": lambda d: build_gpt_neox(d, parallel_residual=True, rotary_pct=0.25),
    "neox_sequential_r050": lambda d: build_gpt_neox(d, parallel_residual=False, rotary_pct=0.5),
    "neox_reward": build_gpt_neox_reward,
    "qwen2_reward": build_qwen2_reward,
    "tokenizer": build_tokenizer,
}
CAUSAL_LMS = (
    "qwen2_tied",
    "qwen2_untied",
    "llama3",
    "mistral_sliding",
    "neox_parallel_r025",
    "neox_sequential_r050",
)
REWARD_MODELS = ("neox_reward", "qwen2_reward")
