"""Config-only model folders for compile-only runs (`--compile_only` reads config.json and a tokenizer, no weights).

The `config.json` values are those of the public Hugging Face checkpoints; the tokenizer is a tiny offline one
(compile-only needs only its EOS and pad ids), so these folders build with no network:

    python bench/fit_models.py DIR            # writes DIR/<name>/ for every model of MODELS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False, bos_token_id=151643,
             eos_token_id=151645)
MODELS: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Pythia-1B": dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_act="gelu",
                      hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
                      vocab_size=50304, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                      layer_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
                      attention_bias=True, bos_token_id=0, eos_token_id=0),
    "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # Qwen/Qwen3-8B's config.json
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     attention_bias=False, rope_theta=1000000.0, max_position_embeddings=40960,
                     use_sliding_window=False, sliding_window=None, max_window_layers=36, bos_token_id=151643,
                     eos_token_id=151645),
    # google/gemma-3-12b-it's text_config, as a text-only Gemma3ForCausalLM (old-style rope keys, as on the hub)
    "Gemma-3-12B": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, hidden_size=3840,
                        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, vocab_size=262208, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
                        attn_logit_softcapping=None, final_logit_softcapping=None, max_position_embeddings=131072,
                        bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0),
}
# Qwen/Qwen3-30B-A3B's config.json (128 experts, 8 a token: ~3.3B active of 30.5B)
MODELS["Qwen3-30B-A3B"] = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
                               rms_norm_eps=1e-6, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False,
                               vocab_size=151936, tie_word_embeddings=False, attention_bias=False,
                               rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                               use_sliding_window=False, sliding_window=None, max_window_layers=48,
                               bos_token_id=151643, eos_token_id=151645)
# openai/gpt-oss-20b's config.json (32 experts, 4 a token: ~3.6B active of 20.9B), without its quantization_config
# (compile-only reads no weights; the MXFP4 experts are dequantized on load)
MODELS["gpt-oss-20b"] = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_act="silu",
                             rms_norm_eps=1e-5, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                             num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                             num_experts_per_tok=4, experts_per_token=4, router_aux_loss_coef=0.9,
                             output_router_logits=False, attention_bias=True, sliding_window=128,
                             layer_types=["sliding_attention", "full_attention"] * 12, swiglu_limit=7.0,
                             rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                                                   beta_slow=1.0, truncate=False,
                                                                   original_max_position_embeddings=4096),
                             initial_context_length=4096, max_position_embeddings=131072, vocab_size=201088,
                             tie_word_embeddings=False, pad_token_id=199999, eos_token_id=200002)
# Llama-3.1-70B: the published architecture (its config.json; no weights needed to compile)
MODELS["Llama-3.1-70B"] = dict(MODELS["Llama-3.1-8B"], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8)


def write_model(root: Path, name: str) -> Path:
    """DIR/<name>/ with config.json and a tiny word-level tokenizer (EOS = the config's first eos id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = MODELS[name]
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    vocab = {f"w{i}": i for i in range(64) if i != eos} | {"<eos>": eos}  # (Pythia's EOS is id 0)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0" if eos != 0 else "w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>").save_pretrained(out)
    return out


def write_reward_model(root: Path, name: str) -> Path:
    """DIR/<name>-rm/: `name`'s config as a one-label `*ForSequenceClassification` (a reward or value model of its
    tokenizer), with the same tokenizer files."""
    import shutil

    folder = write_model(root, name)
    out = root / f"{name}-rm"
    shutil.copytree(folder, out, dirs_exist_ok=True)
    cfg = dict(MODELS[name], num_labels=1)
    cfg["architectures"] = [cfg["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


if __name__ == "__main__":
    for model in MODELS:
        print(write_model(Path(sys.argv[1]), model))
