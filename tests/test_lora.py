"""LoRA: our adapted forward against peft's, adapters as the only trainable state, the base as the reference,
export / load / merge, the scanned and remat paths, the trainer with --use_peft."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax import nnx

import rloo_jax as rj
from rloo_jax.cli import main
from rloo_jax.models import LoRAParam, ModelLoadError, load_causal_lm, lora_spec, save_adapter, save_pretrained
from rloo_jax.models.lora import init_adapters, merge_adapters, merge_params, split_adapters, with_adapters
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import StepConfig, completion_logps
from tests.checkpoints import PAD_ID
from tests.xla_flags import cli_at_xla_defaults


def _batch(seed=0, t=7):
    ids = np.random.RandomState(seed).randint(3, 280, size=(2, t)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return np.where(mask == 1, ids, PAD_ID), mask


def _randomised(model, seed=0, std=0.3):
    """Every adapter weight random (B too), so an adapter that is dropped, transposed or misplaced shows up."""
    graphdef, adapters, base = split_adapters(model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), base)


def _logits(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))


def _hf_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits.numpy()


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parity
@pytest.mark.parametrize(
    "name, targets, rslora",
    [
        ("qwen2_tied", "all-linear", False),
        ("llama3", ["q_proj", "down_proj"], True),
        ("neox_parallel_r025", None, False),  # peft's default: the fused query_key_value
        ("neox_sequential_r050", "all-linear", False),
        ("qwen3", "all-linear", False),  # the per-head q/k norms sit between the adapted q/k and RoPE
        ("phi3", "all-linear", False),  # fused qkv_proj and gate_up_proj: one A each, B split
        ("phi3", ["gate_up_proj", "down_proj"], True),
        ("gemma2", None, False),  # peft's default q_proj, v_proj; soft-capped
    ],
)
def test_adapter_loads_in_peft_with_our_logits(tiny_checkpoint, tmp_path, name, targets, rslora):
    path = tiny_checkpoint(name)
    base = load_causal_lm(path)
    spec = lora_spec(base.config.family, 4, 8, 0.1, targets, rslora)
    model = _randomised(with_adapters(base, spec, jax.random.key(0)))
    out = save_adapter(model, tmp_path / "adapter", str(path))
    ids, mask = _batch()
    ours = _logits(model, ids, mask)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(hf, out).eval()
    diff = np.abs(ours - _hf_logits(theirs, ids, mask))[mask == 1].max()
    plain = np.abs(_logits(base, ids, mask) - ours)[mask == 1].max()
    print(f"{name}: peft vs ours max abs diff {diff:.2e} (adapters move the logits by {plain:.2e})")
    assert diff <= 1e-4 and plain > 1e-2
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(path) and config["r"] == 4

    # load_causal_lm(adapter folder) = base + the same adapters
    again = load_causal_lm(out)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # merged: W + scale A B, a plain HF folder transformers loads with the adapted logits
    merged = save_pretrained(merge_adapters(model), tmp_path / "merged")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    assert np.abs(_hf_logits(hf_merged, ids, mask) - ours)[mask == 1].max() <= 1e-4


def test_targets_and_scale():
    spec = lora_spec("llama", 8, 16, targets=["q_proj", "o_proj", "q_proj"])
    assert spec.targets == ("q_proj", "o_proj") and spec.modules == {"q", "o"} and spec.scale == 2.0
    assert lora_spec("llama", 16, 8, use_rslora=True).scale == 2.0  # alpha / sqrt(r)
    assert lora_spec("gpt_neox", 4, 4).targets == ("query_key_value",)
    assert len(lora_spec("llama", 4, 4, targets="all-linear").targets) == 7
    with pytest.raises(ModelLoadError, match="q_proj is not a projection of a gpt_neox model; choose from "
                                             "query_key_value, dense"):
        lora_spec("gpt_neox", 4, 4, targets=["q_proj"])
    # Phi-3's fused modules, under peft's names: one adapter each, its B split into our q/k/v or gate/up
    assert lora_spec("phi3", 4, 4).targets == ("qkv_proj",) and lora_spec("phi3", 4, 4).modules == {"qkv"}
    assert lora_spec("phi3", 4, 4, targets="all-linear").modules == {"qkv", "o", "gate_up", "down"}
    with pytest.raises(ModelLoadError, match="q_proj is not a projection of a phi3 model; choose from qkv_proj, "
                                             "o_proj, gate_up_proj, down_proj"):
        lora_spec("phi3", 4, 4, targets=["q_proj"])


@pytest.mark.parametrize("name", ["phi3", "neox_parallel_r025"])
def test_fused_adapters_are_matrices_to_the_optimizer_and_the_sampler(tiny_checkpoint, name):
    """Every adapter weight, the fused modules' shared A (`qkv_lora_a`, `gate_up_lora_a`) included, gets weight decay
    and is cast to the compute dtype for decoding, as the other matrices."""
    from rloo_jax.optimizer import decay_mask
    from rloo_jax.sampling import compute_dtype_weights

    base = load_causal_lm(tiny_checkpoint(name), dtype="bfloat16", param_dtype="float32")
    model = with_adapters(base, lora_spec(base.config.family, 4, 8, targets="all-linear"), jax.random.key(0))
    graphdef, adapters, _ = split_adapters(model)
    names = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    assert any("gate_up_lora_a" in n for n in names) == (name == "phi3") and any("qkv_lora_a" in n for n in names)
    assert all(jax.tree.leaves(decay_mask(adapters)))
    cast = compute_dtype_weights(graphdef, nnx.state(model))
    cast_adapters = nnx.state(nnx.merge(graphdef, cast), LoRAParam)
    assert {x.dtype for x in jax.tree.leaves(cast_adapters)} == {jnp.dtype("bfloat16")}


def test_init_is_peft_s_and_layout_independent():
    """A ~ U(-1/sqrt(din), 1/sqrt(din)), B = 0, the same numbers stacked or per layer; the first policy = base."""
    cfg = rj.models.config_from_hf(TINY).replace(lora=lora_spec("llama", 4, 8, targets="all-linear"))
    stacked = nnx.state(rj.models.CausalLM(cfg, nnx.Rngs(0)), LoRAParam)
    listed = nnx.state(rj.models.CausalLM(cfg.replace(scan_layers=False), nnx.Rngs(0)), LoRAParam)
    key = jax.random.key(3)
    s, lst = nnx.to_pure_dict(init_adapters(stacked, key)), nnx.to_pure_dict(init_adapters(listed, key))
    q = s["model"]["layers"]["attn"]["q"]
    for i in range(2):
        np.testing.assert_array_equal(q["lora_a"][i], lst["model"]["layers"][i]["attn"]["q"]["lora_a"])
    assert np.all(q["lora_b"] == 0) and 0 < np.abs(q["lora_a"]).max() <= 1 / np.sqrt(32)
    assert np.abs(q["lora_a"]).max() > 0.9 / np.sqrt(32)  # uniform over the whole range, not a narrow normal


# ------------------------------------------------------------------------------------------------ the step
TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
)
EOS, PAD, G, C = 3, 0, 4, 6


def _prompts():
    ids = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], np.int32)
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


def _step(beta=0.1, dropout_seed=None, recompute_old_logps=None, **options):
    base = rj.models.init_causal_lm(TINY, seed=0, **options)
    spec = lora_spec("llama", 4, 8, 0.2, "all-linear")
    graphdef, adapters, frozen = split_adapters(with_adapters(base, spec, jax.random.key(1)))
    sampling = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9, eos_token_ids=(EOS,),
                              pad_token_id=PAD)
    cfg = StepConfig(sampling=sampling, algorithm=rj.RLOO(beta=beta, token_level_kl=True),
                     dropout_seed=dropout_seed, recompute_old_logps=recompute_old_logps)
    step = Programs(graphdef, optax.adam(1e-2), cfg, ref_graphdef=nnx.graphdef(base))
    return step, step.init_state(adapters, frozen=frozen)


def _rewards(rollout):
    ids = np.asarray(rollout.completion_ids)
    return jnp.asarray((ids % 2 == 0).mean(1).astype(np.float32)[:, None])


def test_base_is_the_reference_and_only_adapters_train():
    step, state = _step(recompute_old_logps=True)  # the KL's old log-probs from the reference's path
    assert state.ref_params is None  # no reference copy
    frozen = jax.tree.map(np.asarray, state.frozen)
    adapters = jax.tree.map(np.asarray, state.params)
    ids, mask = _prompts()
    rollout = step.rollout(state, ids, mask, jax.random.key(0))
    # B = 0: the policy's training-path log-probs equal the reference's (the base, adapters off): this eager call
    # and the jitted reference pass round differently; within one program they are equal (the KL below)
    policy = completion_logps(step.graphdef, merge_params(state.frozen, state.params), rollout.prompt_ids,
                              rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask, 0.9, 64)
    np.testing.assert_allclose(np.asarray(policy * rollout.completion_mask), np.asarray(rollout.ref_logps),
                               atol=1e-6)
    state, metrics = step.update(state, rollout, _rewards(rollout), jnp.ones((1,)))
    metrics = flat_metrics(metrics)
    # the KL at the first update: the policy (adapters with B = 0) and the base computed in one program by the
    # same training forward: exactly 0. (With the sampler's log-probs it is their float32 rounding gap: 1.8e-7
    # measured on this CPU, 2e-8 on another.)
    assert float(metrics["kl"]) == 0.0
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # the base never moves
    # only B has a gradient at step 1 (A's is x^T (g B^T) = 0 with B = 0); every B moved
    new = nnx.to_pure_dict(state.params)
    old = nnx.to_pure_dict(adapters)
    for path, b in jax.tree_util.tree_leaves_with_path(new):
        before = old
        for k in path:
            before = before[k.key]
        moved = np.abs(np.asarray(b) - before).max()
        assert (moved > 0) if path[-1].key == "lora_b" else (moved == 0), (path, moved)
    assert jax.tree.structure(state.opt_state[0].mu) == jax.tree.structure(state.params)  # adapters only


def test_given_adapters_keep_a_frozen_copy_as_the_reference():
    """Adapters that start non-zero (a PEFT adapter folder, a PeftModel): the reference is the base with a frozen
    copy of them (TRL 1.16's "ref" adapter), not the base with the adapters off; the copy never moves."""
    step, state = _step(recompute_old_logps=True)
    key = jax.random.key(3)
    given = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(key, x.shape, x.dtype), state.params)  # B != 0
    copy = jax.tree.map(jnp.copy, given)
    kept = jax.tree.map(np.asarray, given)
    with_copy = step.init_state(given, ref_params=copy, frozen=state.frozen)
    assert jax.tree.structure(with_copy.ref_params) == jax.tree.structure(with_copy.params)
    ids, mask = _prompts()
    rollout = step.rollout(with_copy, ids, mask, jax.random.key(0))
    off = step.rollout(step.init_state(jax.tree.map(jnp.copy, kept), frozen=state.frozen), ids, mask,
                       jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(rollout.completion_ids), np.asarray(off.completion_ids))
    # the copy's reference = the policy's own log-probs (one program, one forward); adapters off: another policy
    np.testing.assert_array_equal(np.asarray(rollout.ref_logps), np.asarray(rollout.old_logps))
    assert np.abs(np.asarray(off.ref_logps) - np.asarray(rollout.ref_logps)).max() > 0.1
    state, metrics = step.update(with_copy, rollout, _rewards(rollout), jnp.ones((1,)))
    assert float(flat_metrics(metrics)["kl"]) == 0.0
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(state.ref_params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # the reference copy never moves
    assert any(np.abs(a - np.asarray(b)).max() > 0 for a, b in zip(jax.tree.leaves(kept),
                                                                     jax.tree.leaves(state.params), strict=True))


def test_lora_dropout_changes_the_update_deterministically():
    ids, mask = _prompts()
    outs = []
    for seed in (None, 0, 0, 1):
        step, state = _step(dropout_seed=seed)
        rollout = step.rollout(state, ids, mask, jax.random.key(0))
        for _ in range(2):  # B != 0 after the first update: dropout on A's input shows in the loss
            state, metrics = step.update(state, rollout, _rewards(rollout), jnp.ones((1,)))
            metrics = flat_metrics(metrics)
        outs.append(float(metrics["loss"]))
    assert outs[1] == outs[2] and len({outs[0], outs[1], outs[3]}) == 3


@pytest.mark.parametrize("options", [dict(scan_layers=False), dict(scan_layers=True, remat_policy="full")])
def test_scan_and_remat_agree_with_the_unrolled_step(options):
    ids, mask = _prompts()
    results = []
    for opts in (dict(scan_layers=False, remat_policy="none"), options):
        step, state = _step(**opts)
        rollout = step.rollout(state, ids, mask, jax.random.key(0))
        for _ in range(2):
            state, metrics = step.update(state, rollout, _rewards(rollout), jnp.ones((1,)))
            metrics = flat_metrics(metrics)
        results.append((float(metrics["loss"]), _by_name(state.params)))
    (la, pa), (lb, pb) = results
    assert abs(la - lb) <= 1e-5 and pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], atol=1e-5, err_msg=name)


def _by_name(params):
    """{name without layer index: values stacked over layers}, whichever the layout."""
    from rloo_jax.models.lora import _name

    layers = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name, layer = _name(path)
        layers.setdefault(name, {})[layer] = np.asarray(x)
    return {k: v[None] if None in v else np.stack([v[i] for i in sorted(v)]) for k, v in layers.items()}


# ------------------------------------------------------------------------------------------------ the trainer
# float32 at full matmul precision on every platform (the CPU's defaults): step 1's KL of zero adapters is 0 to 1e-6
# (a GPU's default bf16 run measured 5.8e-4 on an H200: the policy and reference programs round differently)
ARGS = ["--use_peft", "--lora_target_modules", "all-linear", "--eval_steps", "None", "--compilation_cache", "false",
        "--bf16", "false", "--matmul_precision", "highest"]


def test_cli_use_peft_writes_a_peft_adapter_and_a_merged_model(tmp_path):
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1", "--save_steps", "2",
            "--merge_adapter_on_export", "--lora_r", "4", *ARGS,
            "--reward_funcs", "rloo_jax.demo:letters_reward"]  # dense: adapters that move from zero
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and len(config["target_modules"]) == 7
    base_dir = config["base_model_name_or_path"]
    model = load_causal_lm(out / "final")
    ids, mask = _batch(t=9)
    ids = ids % (model.config.vocab_size - 3) + 3
    ours = _logits(model, ids, mask)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    theirs = _hf_logits(peft.PeftModel.from_pretrained(hf, out / "final").eval(), ids, mask)
    assert np.abs(ours - theirs)[mask == 1].max() <= 1e-4
    merged = _logits(load_causal_lm(out / "final_merged"), ids, mask)
    assert np.abs(merged - ours)[mask == 1].max() <= 1e-4
    # the checkpoint holds the adapters, not the base; resuming without --use_peft is refused in one line
    assert main(["--output_dir", str(out), "--max_steps", "4", "--eval_steps", "None"]) == 2


@pytest.mark.slow
def test_default_demo_learns_with_use_peft(tmp_path):
    """The built-in demo with --use_peft: the mean reward of the last fifth of logged steps beats the first."""
    out = tmp_path / "learn"
    r = cli_at_xla_defaults("--output_dir", str(out), "--max_steps", "120", "--logging_steps", "5", "--save_steps",
                            "1000", *ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    rewards = [r["reward"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    fifth = len(rewards) // 5
    first, last = np.mean(rewards[:fifth]), np.mean(rewards[-fifth:])
    assert last - first >= 0.2, (first, last, rewards)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--use_peft", "--sync_ref_model"], "sync_ref_model cannot be used with use_peft"),
        (["--merge_adapter_on_export"], "merge_adapter_on_export merges LoRA adapters, but use_peft is off"),
        (["--use_peft", "--lora_r", "0"], "lora_r must be >= 1"),
        (["--use_peft", "--lora_target_modules", "q_proj,qproj"], "qproj is not a projection of a llama model"),
    ],
)
def test_bad_lora_options_exit_2_with_one_line(tmp_path, capsys, args, message):
    assert main(["--output_dir", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
