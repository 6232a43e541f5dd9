"""The families of issue 32 (Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, Llama 3.2, SmolLM3) against transformers:
greedy decoding = `generate`, export round trips of both heads, the training log-probs (and the sampler's) =
log_softmax of transformers' (soft-capped) logits, LongRoPE's short regime, old config formats, and the
unsupported-architecture error at construction. Logits and reward-score parity for every family: tests/test_models.py
(`CAUSAL_LMS`, `REWARD_MODELS`); LoRA vs peft: tests/test_lora.py; fused attention: tests/test_attention.py."""

import json
import shutil

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

import rloo_jax
from rloo_jax import sampling
from rloo_jax.logprobs import per_token_logps_from_hidden
from rloo_jax.models import (
    ModelLoadError,
    check_checkpoint,
    config_from_hf,
    load_causal_lm,
    load_reward_model,
    save_pretrained,
)
from rloo_jax.step import completion_logps
from tests.checkpoints import FAMILIES, PAD_ID, build_family, build_gpt_oss

# Left-padded prompts of lengths 4, 7 and 5 (P = 7); ids avoid the pad id. Row 1 is unpadded, so the longest
# position any forward or decode step sees is the same for transformers (arange over the padded row) and us (real
# tokens), which is what picks Phi-3's LongRoPE factors.
PROMPT_IDS = np.array([[0, 0, 0, 17, 90, 41, 5], [5, 210, 33, 8, 150, 77, 64], [0, 0, 120, 9, 250, 31, 3]], np.int32)
PROMPT_MASK = (PROMPT_IDS != PAD_ID).astype(np.int32)
C = 10
MIN_MARGIN = 1e-3  # greedy parity is meaningful only where the top-2 logits are further apart than float noise


def _hf(cls, path):
    model, info = cls.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(np.asarray(ids)).long(),
                  attention_mask=torch.tensor(np.asarray(mask)).long()).logits.numpy()


# ------------------------------------------------------------------------------------------------ decoding
@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate(tiny_checkpoint, family):
    """Prefill once, decode from the KV cache (Gemma's per-layer windows and RoPE bases, SmolLM3's NoPE layer,
    Phi-3's LongRoPE short factors and window) = transformers' greedy `generate`."""
    path = tiny_checkpoint(family)
    model, hf = load_causal_lm(path), _hf(transformers.AutoModelForCausalLM, path)
    ours = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(0), max_new_tokens=C,
                             temperature=0.0, pad_token_id=PAD_ID, prompt_bucket=8)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(PROMPT_IDS).long(),
                          attention_mask=torch.from_numpy(PROMPT_MASK).long(), do_sample=False, max_new_tokens=C,
                          eos_token_id=None, pad_token_id=PAD_ID, top_k=None, top_p=None, temperature=None)
    expected = out[:, PROMPT_IDS.shape[1]:].numpy()
    # every greedy choice was clear (a near-tie could flip between torch and XLA whatever the implementation)
    ids = np.concatenate([PROMPT_IDS, expected], axis=1)
    logits = _hf_logits(hf, ids, np.concatenate([PROMPT_MASK, np.ones_like(expected)], axis=1))
    top2 = np.sort(logits[:, PROMPT_IDS.shape[1] - 1:-1], axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > MIN_MARGIN
    np.testing.assert_array_equal(np.asarray(ours.completion_ids), expected)
    assert len(set(map(tuple, expected))) == 3  # the rows decode differently (not one degenerate token)


# ------------------------------------------------------------------------------------------------ log-probs
@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
def test_training_logps_equal_log_softmax_of_transformers_logits(tiny_checkpoint, family):
    """The update's log-probs (each prompt once, its G completions attending to it, the chunked unembedding with
    Gemma 2's final soft-cap) = log_softmax(logits / T) of transformers' logits over [prompt; completion]."""
    path = tiny_checkpoint(family)
    model, hf = load_causal_lm(path), _hf(transformers.AutoModelForCausalLM, path)
    g, temperature = 2, 0.7
    comp = np.random.RandomState(3).randint(3, 280, size=(3 * g, 6)).astype(np.int32)
    cmask = np.ones_like(comp)
    cmask[1, 4:] = 0
    graphdef, params = nnx.split(model)
    ours = jax.jit(lambda p: completion_logps(graphdef, p, PROMPT_IDS, PROMPT_MASK, comp, cmask, temperature,
                                              chunk=4))(params)
    ids = np.concatenate([np.repeat(PROMPT_IDS, g, 0), comp], axis=1)
    mask = np.concatenate([np.repeat(PROMPT_MASK, g, 0), cmask], axis=1)
    logits = torch.tensor(_hf_logits(hf, ids, mask)[:, PROMPT_IDS.shape[1] - 1:-1])
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(comp).long()[..., None])[..., 0]
    diff = np.abs(np.asarray(ours) - ref.numpy())[cmask == 1].max()
    print(f"{family}: training log-probs vs transformers' log_softmax: max abs diff {diff:.2e}")
    assert diff <= 1e-4  # measured <= 4e-6


@pytest.mark.parity
def test_gemma2_sampler_logps_and_entropy_see_the_soft_capped_logits(tiny_checkpoint):
    """Sampling at T=0.7 with Gemma 2's final soft-cap 3: each sampled token's log-prob = log_softmax(capped logits
    / T) of transformers' logits, and the chunked log-prob gradient with a frozen head (LoRA) = autodiff's."""
    path = tiny_checkpoint("gemma2")
    model, hf = load_causal_lm(path), _hf(transformers.AutoModelForCausalLM, path)
    gen = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(1), max_new_tokens=6,
                            num_generations=2, temperature=0.7, pad_token_id=PAD_ID, prompt_bucket=8)
    ids = np.concatenate([np.repeat(PROMPT_IDS, 2, 0), np.asarray(gen.completion_ids)], axis=1)
    mask = np.concatenate([np.repeat(PROMPT_MASK, 2, 0), np.asarray(gen.completion_mask)], axis=1)
    logits = _hf_logits(hf, ids, mask)
    assert np.abs(logits).max() <= 3.0 and np.abs(logits).max() > 2.0  # capped at 3, and the cap is reached
    logits = torch.tensor(logits[:, PROMPT_IDS.shape[1] - 1:-1])
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(np.asarray(gen.completion_ids)).long()[..., None])
    np.testing.assert_allclose(np.asarray(gen.logps), ref[..., 0].numpy(), atol=1e-5)

    h = jnp.asarray(np.random.RandomState(4).normal(size=(2, 5, model.config.hidden_size)), jnp.float32)
    tok = jnp.asarray(np.random.RandomState(5).randint(0, model.config.vocab_size, (2, 5)))
    grads = [jax.grad(lambda h, f=f: per_token_logps_from_hidden(h, model.unembed, tok, 0.7, chunk_size=2,
                                                                  frozen_unembed=f).sum())(h) for f in (False, True)]
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-6)


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", ["causal_lm", "reward"])
def test_export_round_trip_is_exact(tiny_checkpoint, tmp_path, family, head):
    """save_pretrained writes the very tensors transformers saved (same names, bit-equal) and a config.json that
    transformers loads (no missing or unexpected weights, same outputs) and that reads back to the same config."""
    name = family if head == "causal_lm" else f"{family}_reward"
    path = tiny_checkpoint(name)
    load, cls = (load_causal_lm, transformers.AutoModelForCausalLM) if head == "causal_lm" else \
        (load_reward_model, transformers.AutoModelForSequenceClassification)
    model = load(path)
    out = save_pretrained(model, tmp_path / "export")
    theirs, ours = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(theirs) == sorted(ours)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    original, exported = (json.loads((p / "config.json").read_text()) for p in (path, out))
    assert exported["architectures"] == original["architectures"]
    assert config_from_hf(exported) == config_from_hf(original)
    hf = _hf(cls, out)
    ids, mask = PROMPT_IDS, PROMPT_MASK
    ref = _hf_logits(hf, ids, mask) if head == "causal_lm" else _hf_logits(hf, ids, mask)[:, 0]
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(got - ref)[mask == 1].max() <= 1e-5 if head == "causal_lm" else np.abs(got - ref).max() <= 1e-5


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parity
def test_phi3_longrope_long_factors_past_the_original_context(tiny_checkpoint):
    """Rows wider than original_max_position_embeddings (20) take the long factors, as HF's forward does (the
    parity batches of test_models and the greedy test stay within it: short factors); a rollout of 8 + 16 tokens
    samples with them too, so its log-probs equal HF's forward over [prompt; completion] (TRL's log-probs)."""
    path = tiny_checkpoint("phi3")
    model, hf = load_causal_lm(path), _hf(transformers.AutoModelForCausalLM, path)
    ids = np.random.RandomState(6).randint(3, 280, size=(2, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours - _hf_logits(hf, ids, mask))[mask == 1].max() <= 1e-4
    factors = dict(model.config.rope_factors)
    short = load_causal_lm(path, rope_factors=tuple((k, factors["short_factor"] if k == "long_factor" else v)
                                                    for k, v in model.config.rope_factors))
    assert np.abs(np.asarray(short(jnp.asarray(ids), jnp.asarray(mask))) - ours)[mask == 1].max() > 1e-2

    gen = sampling.generate(model, PROMPT_IDS, PROMPT_MASK, key=jax.random.key(2), max_new_tokens=16,
                            temperature=0.7, pad_token_id=PAD_ID, prompt_bucket=8)
    full = np.concatenate([PROMPT_IDS, np.asarray(gen.completion_ids)], axis=1)  # 7 + 16 = 23 > 20 tokens
    logits = torch.tensor(_hf_logits(hf, full, np.concatenate([PROMPT_MASK, np.asarray(gen.completion_mask)], 1)))
    ref = torch.log_softmax(logits[:, 6:-1] / 0.7, -1).gather(-1, torch.tensor(full[:, 7:]).long()[..., None])
    np.testing.assert_allclose(np.asarray(gen.logps), ref[..., 0].numpy(), atol=1e-5)


def test_old_config_formats_read_as_new():
    """Hub files written before transformers 5: Gemma 3's rope_theta / rope_local_base_freq / rope_scaling /
    sliding_window_pattern, Phi-3's rope_scaling {type: su} with a top-level original_max_position_embeddings,
    Gemma 2 without layer_types, SmolLM3 with only no_rope_layer_interval."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                head_dim=8, num_key_value_heads=2)
    new = transformers.Gemma3TextConfig(**base, sliding_window=16, layer_types=["sliding_attention"] * 5 +
                                        ["full_attention"], rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = {**base, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "sliding_window": 16,
           "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    a, b = config_from_hf(new.to_dict()), config_from_hf(old)
    assert a == b and a.windows == (16,) * 5 + (None,) and a.rope_kinds == (1,) * 5 + (0,)
    assert a.local_rope_theta == 1e4 and a.rope_type == "linear" and a.attn_scale == 256**-0.5  # HF's default 256

    su = {**base, "model_type": "phi3", "max_position_embeddings": 64, "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}
    p = config_from_hf(su)
    assert p.rope_type == "longrope" and dict(p.rope_factors)["original_max_position_embeddings"] == 16
    # HF's attention factor: sqrt(1 + ln(64 / 16) / ln(16))
    assert dict(p.rope_factors)["attention_factor"] == pytest.approx((1 + np.log(4) / np.log(16)) ** 0.5)

    g2 = config_from_hf({**base, "model_type": "gemma2"})
    assert g2.layer_types == tuple(transformers.Gemma2Config(**base).layer_types)
    assert g2.layer_types == ("sliding_attention", "full_attention") * 3
    assert (g2.attn_softcap, g2.final_softcap, g2.sliding_window, g2.tie_word_embeddings) == (50.0, 30.0, 4096, True)
    s3 = config_from_hf({**base, "model_type": "smollm3", "no_rope_layer_interval": 3})
    assert s3.rope_kinds == (0, 0, 2, 0, 0, 2) and s3.rope_theta == 2e6
    assert config_from_hf({**base, "model_type": "qwen3"}).head_dim == 8  # head_dim given in base
    assert config_from_hf({k: v for k, v in base.items() if k != "head_dim"} | {"model_type": "qwen3"}).head_dim == 128
    # Qwen3 with use_sliding_window: the layers from max_window_layers on slide, as Qwen3Config derives them
    q3 = dict(base, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    ours = config_from_hf({**q3, "model_type": "qwen3"})
    assert ours.layer_types == tuple(transformers.Qwen3Config(**q3).layer_types)
    assert ours.windows == (None, None, 4, 4, 4, 4)
    assert config_from_hf({**q3, "model_type": "qwen3", "use_sliding_window": False}).windows == (None,) * 6


# ------------------------------------------------------------------------------------------------ errors
COHERE2 = {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 32}


def test_unsupported_architecture_fails_at_construction(tiny_checkpoint, tmp_path):
    """TRL's tiny test models name architectures we do not build (Cohere2, GLM-4-MoE, ...): RLOOTrainer(...) and
    the config check refuse them before anything is loaded, naming what is supported."""
    folder = tmp_path / "cohere2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(COHERE2))
    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2)
    rows = [{"prompt": "a"}] * 4
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'Cohere2ForCausalLM'; supported: .*"
                                             r"Gemma2ForCausalLM.*Phi3ForCausalLM.*Qwen3ForCausalLM"):
        rloo_jax.RLOOTrainer(str(folder), lambda completions, **_: [0.0] * len(completions), args=args,
                             train_dataset=rows)
    assert not (tmp_path / "out").exists()
    # a reward model folder is checked at construction too, as a sequence classifier
    with pytest.raises(ModelLoadError, match="not a reward model"):
        rloo_jax.RLOOTrainer(str(tiny_checkpoint("qwen3")), [str(tiny_checkpoint("qwen3"))], args=args,
                             train_dataset=rows)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'Gemma3ForConditionalGeneration' \\(the "
                                             "multimodal Gemma 3"):
        shutil.copytree(tiny_checkpoint("gemma3"), tmp_path / "mm")
        (tmp_path / "mm" / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"]}))
        check_checkpoint(tmp_path / "mm")


def test_unsupported_architecture_exits_2_from_the_cli(tmp_path, capsys):
    from rloo_jax.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(COHERE2))
    assert main(["--model_name_or_path", str(tmp_path / "m"), "--dataset_name", "demo", "--reward_funcs",
                 "rloo_jax.demo:letters_reward", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture 'Cohere2ForCausalLM'; supported:" in err and "Qwen3ForCausalLM" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------------ acceptance
@pytest.mark.slow  # ~20 s: compiles the rollout and the update of a tiny Qwen3
def test_rloo_trainer_trains_a_tiny_qwen3(tmp_path, tiny_checkpoint):
    """The issue's acceptance run: TRL's RLOO test recipe (a tiny Qwen3ForCausalLM, RLOOTrainer as written, a
    Dataset with a prompt column, a reward callable) trains for 3 steps and writes a Qwen3 final/ that
    transformers loads."""
    model_dir = tmp_path / "tiny-Qwen3ForCausalLM"
    build_family(model_dir, "qwen3")
    for f in tiny_checkpoint("tokenizer").iterdir():
        shutil.copy(f, model_dir / f.name)
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sea is", "One plus one is", "Hello"] * 4})

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) / 20 for c in completions]

    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "out"), learning_rate=0.1, per_device_train_batch_size=8,
                               num_generations=4, max_completion_length=8, max_steps=3, logging_steps=1,
                               report_to="none", compilation_cache=False)
    trainer = rloo_jax.RLOOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=dataset)
    before = load_causal_lm(model_dir)
    out = trainer.train()
    last = trainer.state.log_history[-2]  # the last step's record (the end-of-training summary follows it)
    assert out.global_step == trainer.state.global_step == 3 and np.isfinite(out.training_loss)
    assert np.isfinite(last["loss"]) and "reward" in last
    final = tmp_path / "out" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    after = load_causal_lm(final)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(before, nnx.Param)),
                                                         jax.tree.leaves(nnx.state(after, nnx.Param)), strict=True)]
    assert all(changed)  # every parameter moved, the q/k norms included
    _hf(transformers.AutoModelForCausalLM, final)


@pytest.mark.slow  # compiles the rollout and the update
def test_rloo_trainer_trains_a_tiny_gpt_oss(tmp_path, tiny_checkpoint):
    """RLOOTrainer (TRL's recipe: a prompt dataset, a reward callable) trains the tiny GPT-OSS for 2 steps with
    routing replay and writes a GptOssForCausalLM final/ that transformers loads; the sinks, the router's bias and
    the attention moved."""
    model_dir = tmp_path / "tiny-GptOssForCausalLM"
    path = build_gpt_oss(model_dir)
    before = load_file(str(path / "model.safetensors"))
    for f in tiny_checkpoint("tokenizer").iterdir():
        shutil.copy(f, model_dir / f.name)
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sea is", "One plus one is", "Hello"] * 4})

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) / 20 for c in completions]

    args = rloo_jax.RLOOConfig(output_dir=str(tmp_path / "out"), learning_rate=0.05, per_device_train_batch_size=8,
                               num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1,
                               report_to="none", compilation_cache=False)
    trainer = rloo_jax.RLOOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=dataset)
    out = trainer.train()
    assert out.global_step == 2 and np.isfinite(out.training_loss)
    final = tmp_path / "out" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    after = load_file(str(final / "model.safetensors"))
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.2.self_attn.q_proj.weight"):
        assert not np.array_equal(before[name], after[name]), name
    _hf(transformers.AutoModelForCausalLM, final)
