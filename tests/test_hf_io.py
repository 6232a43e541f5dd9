"""Hugging Face checkpoint I/O: export round trips, sharded and bf16 files, config formats, errors, tokenizer."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from rloo_jax.models import (
    ModelLoadError,
    config_from_hf,
    init_causal_lm,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    save_pretrained,
)
from tests.checkpoints import EOS_ID, PAD_ID, TINY_SIZE, build_qwen2

TEXTS = [
    "Hello, world!",
    "What is 7 times 6?  The answer is 42.\n",
    "héllo – ünïcode ✓",
    " leading space",
    "12345 apples, don't stop",
    "a    b\n\n  c",
    "",
]


def _batch(seed: int = 0):
    ids = np.random.RandomState(seed).randint(3, 280, size=(2, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return np.where(mask == 1, ids, PAD_ID), mask


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_same_params(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(_params(a))[0], jax.tree_util.tree_flatten_with_path(_params(b))[0]
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (k, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, k
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(k))


def _hf_load(cls, path):
    model, info = cls.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# ----------------------------------------------------------------------------------------------- export
@pytest.mark.parity
@pytest.mark.parametrize("name", ["qwen2_tied", "llama3", "neox_parallel_r025", "mistral_sliding"])
def test_export_loads_in_transformers_with_same_logits(tiny_checkpoint, tmp_path, name):
    model = load_causal_lm(tiny_checkpoint(name))
    out = save_pretrained(model, tmp_path / "export")
    ids, mask = _batch()
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    hf = _hf_load(transformers.AutoModelForCausalLM, out)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits.numpy()
    diff = np.abs(ours - ref)[mask == 1].max()
    print(f"export {name}: transformers vs ours max abs diff {diff:.2e}")
    assert diff <= 1e-5
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(out / "model.safetensors")
    _assert_same_params(model, load_causal_lm(out))


@pytest.mark.parity
def test_reward_export_round_trip(tiny_checkpoint, tmp_path):
    rm = load_reward_model(tiny_checkpoint("neox_reward"))
    out = save_pretrained(rm, tmp_path / "rm")
    ids, mask = _batch(1)
    hf = _hf_load(transformers.AutoModelForSequenceClassification, out)
    assert hf.config.num_labels == 1
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits[:, 0].numpy()
    ours = np.asarray(rm(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours - ref).max() <= 1e-5
    _assert_same_params(rm, load_reward_model(out))


@pytest.mark.parity
def test_random_init_exports_with_tokenizer(tiny_checkpoint, tmp_path):
    hf_config = dict(
        TINY_SIZE,
        model_type="qwen2",
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = init_causal_lm(hf_config, seed=3)
    _assert_same_params(model, init_causal_lm(hf_config, seed=3))
    assert not np.array_equal(
        _params(model)["model"]["embed"]["embedding"],
        _params(init_causal_lm(hf_config, seed=4))["model"]["embed"]["embedding"],
    )
    tok = load_tokenizer(tiny_checkpoint("tokenizer"))
    out = save_pretrained(model, tmp_path / "policy", tokenizer=tok)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ids, mask = _batch(2)
    hf = _hf_load(transformers.AutoModelForCausalLM, out)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ref[mask == 1]).max() > 0.5
    assert np.abs(ours - ref)[mask == 1].max() <= 1e-5
    assert load_tokenizer(out)(TEXTS).input_ids == tok(TEXTS).input_ids


# ----------------------------------------------------------------------------------------------- file formats
def test_sharded_checkpoint_loads(tmp_path):
    single = load_causal_lm(build_qwen2(tmp_path / "single", tied=False, seed=7))
    sharded_dir = build_qwen2(tmp_path / "sharded", tied=False, seed=7, max_shard_size="20KB")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    _assert_same_params(single, load_causal_lm(sharded_dir))


def test_bf16_safetensors_are_read(tiny_checkpoint, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2_untied")).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    with open(tmp_path / "bf16" / "model.safetensors", "rb") as f:
        assert b'"BF16"' in f.read(4096)  # the file really holds bf16 tensors
    model = load_causal_lm(tmp_path / "bf16", param_dtype="float32")
    w = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].float().numpy()
    np.testing.assert_array_equal(np.asarray(_params(model)["model"]["layers"]["attn"]["q"]["kernel"][0]), w.T)
    ids, mask = _batch(3)
    # fresh float32 load of the bf16 file (hf.float() would keep the bf16-rounded rotary inv_freq buffer)
    hf = _hf_load(transformers.AutoModelForCausalLM, tmp_path / "bf16").float()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))) - ref)[mask == 1].max() <= 1e-4
    bf = load_causal_lm(tmp_path / "bf16", dtype="bfloat16")
    assert _params(bf)["lm_head"]["kernel"].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------------------------- config formats
def test_old_and_new_config_formats_agree():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    neox_old = {**base, "architectures": ["GPTNeoXForCausalLM"], "rotary_pct": 0.5, "rotary_emb_base": 500}
    neox_new = {
        **base,
        "model_type": "gpt_neox",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    }
    a, b = config_from_hf(neox_old), config_from_hf(neox_new)
    assert a == b and a.rotary_dim == 4 and a.rope_theta == 500.0 and a.parallel_residual
    assert config_from_hf({**base, "model_type": "gpt_neox"}).rotary_dim == 2  # HF default rotary_pct 0.25
    l3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    llama_old = {**base, "model_type": "llama", "rope_theta": 500.0, "rope_scaling": {"rope_type": "llama3", **l3}}
    llama_new = {**base, "model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 500, **l3}}
    c, d = config_from_hf(llama_old), config_from_hf(llama_new)
    assert c == d and c.rope_type == "llama3" and dict(c.rope_factors)["factor"] == 8.0
    q = config_from_hf({**base, "model_type": "qwen2", "num_key_value_heads": 2})
    assert q.qkv_bias and not q.o_bias and q.tie_word_embeddings and q.num_kv_heads == 2 and q.head_dim == 8
    assert hash(q) == hash(q.replace(hf_config={"other": 1}))  # the raw dict is kept out of hashing
    with pytest.raises(ModelLoadError, match="rope_type 'yarn' is not supported"):
        config_from_hf({**base, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


# ----------------------------------------------------------------------------------------------- errors
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen2_tied"), tmp_path / "bert")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'BertForMaskedLM'.*Qwen2ForCausalLM"):
        load_causal_lm(d)


def test_missing_and_unexpected_weights_are_listed(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen2_tied"), tmp_path / "broken")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        load_causal_lm(d)
    assert "missing: model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "unexpected: model.layers.0.extra.weight" in str(e.value)


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("neox_parallel_r025"), tmp_path / "bad_shape")
    tensors = load_file(d / "model.safetensors")
    tensors["gpt_neox.layers.0.attention.query_key_value.weight"] = np.zeros((48, 32), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"query_key_value.weight: checkpoint shape \(48, 32\), expected \(96, 32\)"
    ):
        load_causal_lm(d)


def test_missing_path_and_wrong_task(tiny_checkpoint, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="hub download failed"):
        load_causal_lm("no-such-user/no-such-model")  # HF_HUB_OFFLINE=1: fails fast
    with pytest.raises(ModelLoadError, match="not a causal LM"):
        load_causal_lm(tiny_checkpoint("neox_reward"))
    with pytest.raises(ModelLoadError, match="not a reward model"):
        load_reward_model(tiny_checkpoint("qwen2_tied"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_causal_lm(tmp_path / "empty")


# ----------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_every_load_path_gives_the_same_ids(tiny_checkpoint, tmp_path):
    tok_dir = tiny_checkpoint("tokenizer")
    tok = load_tokenizer(tok_dir)
    assert tok.padding_side == "left" and tok.pad_token_id == PAD_ID and tok.eos_token_id == EOS_ID
    assert load_tokenizer(tok_dir, padding_side="right").padding_side == "right"
    # a Qwen2 model folder with the tokenizer inside (the DESIGN.md trap: it may be rebuilt as Qwen2Tokenizer)
    model_dir = save_pretrained(load_causal_lm(tiny_checkpoint("qwen2_tied")), tmp_path / "qwen2_with_tok", tok)
    expected = tok(TEXTS).input_ids
    assert max(max(x, default=0) for x in expected) < 280 and len(expected[1]) < len(TEXTS[1])  # merges are used
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    for other in (
        load_tokenizer(model_dir),
        AutoTokenizer.from_pretrained(tok_dir),
        AutoTokenizer.from_pretrained(model_dir),  # comes back as Qwen2Tokenizer here
        PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json")),
    ):
        assert other(TEXTS).input_ids == expected, type(other)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    a = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert a == load_tokenizer(model_dir).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert a == "<|user|>What is 2 + 3?\n<|assistant|>"
    batch = tok(["Hi", "Hello, world!"], padding=True)
    assert batch.input_ids[0][0] == PAD_ID and batch.attention_mask[0][0] == 0  # left padding


def test_tokenizer_without_pad_falls_back_to_eos(tiny_checkpoint, tmp_path):
    from transformers import PreTrainedTokenizerFast

    raw = PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_checkpoint("tokenizer") / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    raw.save_pretrained(tmp_path / "nopad")
    tok = load_tokenizer(tmp_path / "nopad")
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == EOS_ID
