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


# ------------------------------------------------------------------------------------------------ newer families
# Each family's quirks sized so that leaving one out moves the logits well past the 1e-4 parity tolerance.
def qwen3_config(**overrides: Any) -> Any:
    """Qwen3: per-head q/k RMSNorm, no qkv bias, explicit head_dim 16 (not hidden / heads = 8), GQA 4 / 2."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_theta=1000.0,
              **_SPECIAL)
    kw.update(overrides)
    return transformers.Qwen3Config(**kw)


def qwen3_moe_config(**overrides: Any) -> Any:
    """Qwen3-MoE: Qwen3's attention (head_dim 8, GQA 4 / 2) with routed MLPs of 16-wide experts; the expert count,
    top-k and layer pattern come from `overrides`."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, rope_theta=1000.0, **_SPECIAL)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def build_qwen3_moe(out_dir: str | Path, seed: int = 7, reward: bool = False, **overrides: Any) -> Path:
    """A Qwen3MoeForCausalLM checkpoint (`reward`: a Qwen3MoeForSequenceClassification with one label) from
    `qwen3_moe_config(**overrides)`, experts written one tensor each as transformers 5's `save_pretrained` does."""
    if reward:
        return _build(transformers.Qwen3MoeForSequenceClassification, qwen3_moe_config(num_labels=1, **overrides),
                      out_dir, seed)
    return _build(transformers.Qwen3MoeForCausalLM, qwen3_moe_config(**overrides), out_dir, seed)


def gpt_oss_config(**overrides: Any) -> Any:
    """GPT-OSS: 4 layers alternating sliding (window 4, shorter than the tests' rows) / full attention, GQA 4 / 2 with
    head_dim 8, q/k/v/o biases, attention sinks, 8 experts of 16 (top 2) with router and expert biases, the clamped
    SwiGLU with a limit of 1.0 (the tiny model's activations reach it: the clamp is exercised), YaRN RoPE (factor 4
    over 32 original positions, truncate False as GPT-OSS's)."""
    kw = dict(**{**TINY_SIZE, "intermediate_size": 16, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=8,
              num_local_experts=8, num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0,
              rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
              **_SPECIAL)
    kw.update(overrides)
    return transformers.GptOssConfig(**kw)


def build_gpt_oss(out_dir: str | Path, seed: int = 9, reward: bool = False, **overrides: Any) -> Path:
    """A GptOssForCausalLM checkpoint (float32, not quantized; `reward`: a GptOssForSequenceClassification with one
    label) from `gpt_oss_config(**overrides)`; the sinks and the expert biases (which transformers initialises to
    zeros) drawn too: a dropped one changes the logits."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    config = gpt_oss_config(**overrides, **({"num_labels": 1} if reward else {}))
    config._attn_implementation = "eager"
    cls = transformers.GptOssForSequenceClassification if reward else transformers.GptOssForCausalLM
    model = cls(config).float().eval()
    _randomise(model, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def gemma2_config(**overrides: Any) -> Any:
    """Gemma 2: (1 + w) norms around attention and MLP, sqrt(D) embeddings, query_pre_attn_scalar 12 (not
    head_dim 8), attention / final soft-caps 5 / 3 (small, so they bite), layer 0 sliding (window 4), layer 1
    global, tied embeddings."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **_SPECIAL)
    kw.update(overrides)
    return transformers.Gemma2Config(**kw)


def gemma3_config(**overrides: Any) -> Any:
    """Gemma 3 text: Gemma 2's block with per-head q/k norms and no soft-caps, layer 0 sliding (window 4, local
    RoPE base 10) and layer 1 global (base 1000, linear scaling x8, as Gemma 3 4B+)."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
              **_SPECIAL)
    kw.update(overrides)
    return transformers.Gemma3TextConfig(**kw)


def phi3_config(**overrides: Any) -> Any:
    """Phi-3: fused qkv_proj and gate_up_proj, LongRoPE (original context 20: rows up to 20 tokens take the short
    factors, longer ones the long factors) on half of each head (partial_rotary_factor 0.5, as Phi-4-mini's 0.75),
    sliding window 6 on every layer."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, sliding_window=6, original_max_position_embeddings=20,
              tie_word_embeddings=False, **_SPECIAL)
    kw["max_position_embeddings"] = 64
    kw.update(rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "partial_rotary_factor": 0.5,
                               "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0]})
    kw.update(overrides)
    return transformers.Phi3Config(**kw)


def olmo2_config(**overrides: Any) -> Any:
    """OLMo 2: post-norm blocks (norms on the attention and MLP outputs), q/k RMSNorm over the whole projection."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, tie_word_embeddings=False, **_SPECIAL)
    kw.update(overrides)
    return transformers.Olmo2Config(**kw)


def llama32_config(**overrides: Any) -> Any:
    """Llama 3.2: tied embeddings and llama3 RoPE scaling together."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, tie_word_embeddings=True, **_SPECIAL,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def smollm3_config(**overrides: Any) -> Any:
    """SmolLM3: a Llama block whose layer 1 has no RoPE (no_rope_layers [1, 0]); tied embeddings."""
    kw = dict(**TINY_SIZE, num_key_value_heads=2, no_rope_layers=[1, 0], rope_theta=1000.0, **_SPECIAL)
    kw.update(overrides)
    return transformers.SmolLM3Config(**kw)


# family -> (its config builder, causal LM class name, sequence-classification class name)
FAMILIES: dict[str, tuple[Any, str, str]] = {
    "qwen3": (qwen3_config, "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "gemma2": (gemma2_config, "Gemma2ForCausalLM", "Gemma2ForSequenceClassification"),
    "gemma3": (gemma3_config, "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"),
    "phi3": (phi3_config, "Phi3ForCausalLM", "Phi3ForSequenceClassification"),
    "olmo2": (olmo2_config, "Olmo2ForCausalLM", "Olmo2ForSequenceClassification"),
    "llama32": (llama32_config, "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "smollm3": (smollm3_config, "SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification"),
}


def build_family(out_dir: str | Path, family: str, reward: bool = False, seed: int = 11, **overrides: Any) -> Path:
    """A tiny checkpoint of a `FAMILIES` entry: its causal LM, or with `reward` its sequence classifier
    (num_labels 1)."""
    make, lm, rm = FAMILIES[family]
    config = make(**overrides, **({"num_labels": 1} if reward else {}))
    return _build(getattr(transformers, rm if reward else lm), config, out_dir, seed + 50 * reward)


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
    **{f: (lambda d, f=f: build_family(d, f)) for f in FAMILIES},
    **{f"{f}_reward": (lambda d, f=f: build_family(d, f, reward=True)) for f in FAMILIES},
}
CAUSAL_LMS = (
    "qwen2_tied",
    "qwen2_untied",
    "llama3",
    "mistral_sliding",
    "neox_parallel_r025",
    "neox_sequential_r050",
    *FAMILIES,
)
REWARD_MODELS = ("neox_reward", "qwen2_reward", *(f"{f}_reward" for f in FAMILIES))
