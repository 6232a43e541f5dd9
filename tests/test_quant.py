"""QLoRA: `rloo_jax.quant`'s leaf functions (hand goldens, bitsandbytes' own quantizations of one weight, round-trip
bounds), the quantized base in the model (built or quantized, scanned or not, sharding, dequantized, merged), one
update step against the same step on the dequantized and on the unquantized base, the trainer with --load_in_4bit,
and what the TPU compiler makes of 4-bit codes (half a byte each; the dequantization fused into the matmul)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rloo_jax import quant
from rloo_jax.quant import FP4, NF4, QuantSpec, blocked_matmul, dequantize, quantize

DATA = Path(__file__).parent / "data"
SPECS = [QuantSpec("int8"), QuantSpec("nf4"), QuantSpec("fp4"), QuantSpec("nf4", True)]


def _np(x):
    return np.asarray(x, np.float64)


# ------------------------------------------------------------------------------------------------ leaf goldens
def test_codebooks():
    """NF4: QLoRA's 16 values (appendix E), ascending, exact 0 and +-1; FP4: bitsandbytes' sign + 8 magnitudes."""
    assert len(NF4) == len(FP4) == 16 and list(NF4) == sorted(NF4) and list(FP4) == sorted(FP4)
    assert (NF4[0], NF4[7], NF4[15]) == (-1.0, 0.0, 1.0) and NF4[8] == pytest.approx(0.0795803)
    assert FP4[8:] == (0.0, 1 / 192, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1.0)
    assert FP4[:8] == tuple(-x for x in FP4[:7:-1])
    assert quant.block_size(4096) == 64 and quant.block_size(896) == 64 and quant.block_size(32) == 32
    assert quant.group_size(4096) == 256 and quant.group_size(128) == 128


def test_nearest_code_rounds_to_the_nearest_value_ties_down():
    table = np.array([-1.0, 0.0, 1.0], np.float32)
    assert quant.nearest_code(jnp.array([-0.6, 0.5, 0.7, -0.5, 2.0, -3.0]), table).tolist() == [0, 1, 2, 0, 2, 0]


def test_lookup_is_the_codebook_entry():
    """The select tree on the code's 4 bits = table[code], for every code and both codebooks."""
    codes = jnp.arange(16, dtype=jnp.uint8).astype(jnp.uint4)
    for table in (NF4, FP4):
        np.testing.assert_array_equal(np.asarray(quant.lookup(codes, np.asarray(table, np.float32))),
                                      np.asarray(table, np.float32))


def test_int8_hand_golden():
    """One scale per output column: absmax / 127; codes round half to even; a zero column has scale 0."""
    w = jnp.array([[1.0, 0.0, 0.25], [-0.5, 0.0, -0.125]])
    q = quantize(w, QuantSpec("int8"))
    assert q["codes"].dtype == jnp.int8 and q["codes"].tolist() == [[127, 0, 127], [-64, 0, -64]]
    np.testing.assert_allclose(_np(q["scale"]), [[1 / 127, 0.0, 0.25 / 127]], rtol=1e-7)
    np.testing.assert_allclose(_np(dequantize(q, QuantSpec("int8"))), [[1, 0, 0.25], [-64 / 127, 0, -16 / 127]],
                               rtol=1e-6)


def test_4bit_hand_golden():
    """A block of 4 inputs (gcd(4, 64)) per output column, scaled by its absmax to [-1, 1], nearest codebook value:
    [1, -0.5, 0.3, 0] -> NF4 [1, -0.5251, 0.3379, 0] (codes 15, 2, 11, 7), FP4 [1, -1/2, 1/3, 0]."""
    w = jnp.array([[2.0], [-1.0], [0.6], [0.0]])  # absmax 2
    q = quantize(w, QuantSpec("nf4"))
    assert q["codes"].dtype == jnp.uint4 and q["codes"].shape == (4, 1, 1) and q["scale"].shape == (1, 1, 1)
    assert q["codes"].astype(int).ravel().tolist() == [15, 2, 11, 7] and float(q["scale"][0, 0, 0]) == 2.0
    np.testing.assert_allclose(_np(dequantize(q, QuantSpec("nf4"))).ravel(), [2, 2 * NF4[2], 2 * NF4[11], 0])
    f = dequantize(quantize(w, QuantSpec("fp4")), QuantSpec("fp4"))
    np.testing.assert_allclose(_np(f).ravel(), [2, -1, 2 / 3, 0], rtol=1e-7)


def test_double_quant_hand_golden():
    """Scales as uint8 codes of their group's max / 255 (group of 2 output columns here), codes against the scale
    as stored: s [2, 0.5] -> codes [255, 64] (63.75 rounded), s2 2/255, so column 1 dequantizes with
    64 * 2/255 = 0.50196: 0.5 / 0.50196 = 0.9961 -> NF4 1.0, 0.125 / 0.50196 = 0.2490 -> NF4 0.2461 (code 10)."""
    w = jnp.array([[2.0, 0.5], [-1.0, 0.125]])
    q = quantize(w, QuantSpec("nf4", True))
    assert q["scale"].dtype == jnp.uint8 and q["scale"].tolist() == [[[255, 64]]]
    np.testing.assert_allclose(_np(q["scale2"]), [[[2 / 255]]], rtol=1e-6)
    s = 64 * 2 / 255
    np.testing.assert_allclose(_np(dequantize(q, QuantSpec("nf4", True)))[:, 0, 1], [s, s * NF4[10]], rtol=1e-6)


def test_zero_weights_dequantize_to_zero():
    w = jnp.zeros((128, 256))
    for spec in SPECS:
        d = _np(dequantize(quantize(w, spec), spec))
        assert np.all(d == 0), spec


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}{'-dq' * s.double_quant}")
def test_round_trip_error_bound(spec):
    """Each weight is within half a step of its block's grid: int8 |w - deq| <= s / 2; 4-bit <= s x half the
    widest gap of the codebook, s as stored (double quantization rounds it first). The relative RMS error on
    Gaussian weights (measured: int8 0.00736, nf4 0.09196, fp4 0.12177, nf4 + double quant 0.09196) pins the
    grids: fp4's is wider where Gaussian weights are dense (NF4 is their quantiles)."""
    w = jax.random.normal(jax.random.key(0), (512, 256)) * 0.02
    q = quantize(w, spec)
    d = _np(dequantize(q, spec) if spec.kind == "int8" else quant.unblock(dequantize(q, spec)))
    err = np.abs(d - _np(w))
    if spec.kind == "int8":
        assert np.all(err <= _np(q["scale"]) / 2 * (1 + 1e-6))
    else:
        table = np.asarray(quant.codebook(spec.kind), np.float64)
        scale = _np(quant._scales(q))  # as stored: [1, din/K, dout]
        assert np.all(err.reshape(8, 64, 256).swapaxes(0, 1) <= scale * np.diff(table).max() / 2 * (1 + 1e-6) + 1e-12)
    rel = np.sqrt(np.mean(err**2) / np.mean(_np(w) ** 2))
    assert rel == pytest.approx({"int8": 0.00736, "nf4": 0.09196, "fp4": 0.12177}[spec.kind], abs=1e-5)


def test_matches_bitsandbytes():
    """bitsandbytes' quantizations of one weight (tests/data/bnb_quant.npz, written by scripts/bnb_quant_fixture.py
    on its CPU backend): nf4 / fp4 dequantize to the very same values (same blocks, codebooks, rounding), int8
    to the same codes and scales. Its nested quantization (a signed dynamic 8-bit map of the scales minus their
    mean) differs from ours (linear 8 bits against the group's max): both move the weights as little (mean
    deviation from the plain 4-bit weight, relative to its mean magnitude, measured: ours 0.260% nf4 / 0.255% fp4,
    bitsandbytes' 0.230% / 0.231%)."""
    ref = np.load(DATA / "bnb_quant.npz")
    w = jnp.asarray(ref["weight"].astype(np.float32).T)  # torch [out, in] -> our kernel [in, out]
    for kind in ("nf4", "fp4"):
        ours = _np(quant.unblock(dequantize(quantize(w, QuantSpec(kind)), QuantSpec(kind)))).T
        np.testing.assert_array_equal(ours, ref[kind], err_msg=kind)
        nested = _np(quant.unblock(dequantize(quantize(w, QuantSpec(kind, True)), QuantSpec(kind, True)))).T
        plain = np.abs(ref[kind]).mean()
        mine = np.abs(nested - ref[kind]).mean() / plain
        theirs = np.abs(ref[f"{kind}_nested"] - ref[kind]).mean() / plain
        assert 0.002 < theirs < 0.0025 and 0.002 < mine < 0.003, (kind, mine, theirs)
    q = quantize(w, QuantSpec("int8"))
    np.testing.assert_array_equal(np.asarray(q["codes"]).T, ref["int8_codes"])
    np.testing.assert_allclose(_np(q["scale"])[0], ref["int8_absmax"] / 127, rtol=1e-7)


def test_stacked_layers_shapes_and_bytes():
    """Leading axes pass through (stacked layers = each layer alone); codes are uint4 / int8; `stored_bytes` is
    what the arrays hold at their bit widths."""
    w = jax.random.normal(jax.random.key(1), (3, 128, 512))
    for spec in SPECS:
        q = quantize(w, spec)
        for i in range(3):
            one = quantize(w[i], spec)
            for name in q:
                np.testing.assert_array_equal(np.asarray(q[name][i]), np.asarray(one[name]))
        bits = sum(x.size * jax.dtypes.itemsize_bits(x.dtype) for x in q.values())
        assert bits / 8 == 3 * quant.stored_bytes(128, 512, spec), spec
    assert quant.stored_bytes(4096, 4096, QuantSpec("nf4")) == 4096 * 4096 / 2 + 64 * 4096 * 4
    assert quant.stored_bytes(4096, 4096, None) == 4096 * 4096 * 2


def test_decode_floor_counts_codes_at_their_bits():
    """The decode floor's matrices (`efficiency.Transformer.weight_bytes`): Llama-3.1-8B's blocks at 218,103,808
    matmul parameters each; nf4 stores them in 109,051,904 bytes of codes + 13,631,488 of float32 scales (one per
    64); the LM head (4096 x 128256) stays at the compute dtype's 2 bytes."""
    from rloo_jax.efficiency import Transformer
    from rloo_jax.models import config_from_hf

    cfg = config_from_hf(dict(TINY, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    plain, nf4 = Transformer.of(cfg), Transformer.of(cfg, QuantSpec("nf4"))
    assert plain.layer_params == nf4.layer_params == 218103808 and plain.weight_bytes(2) == 2 * plain.matmul_params
    assert nf4.layer_bytes == 109051904 + 13631488
    assert nf4.weight_bytes(2) == 32 * (109051904 + 13631488) + 2 * 4096 * 128256
    assert Transformer.of(cfg.replace(quant=QuantSpec("int8"))).layer_bytes == 218103808 + 4 * (
        4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # one float32 scale per output channel


def test_blocked_matmul_is_the_matmul():
    x = jax.random.normal(jax.random.key(2), (5, 128))
    w = dequantize(quantize(jax.random.normal(jax.random.key(3), (128, 96)), QuantSpec("nf4")), QuantSpec("nf4"))
    assert w.shape == (64, 2, 96)  # [K, din/K, dout]: row b * 64 + k of the kernel is w[k, b]
    kernel = np.concatenate([_np(w)[:, 0], _np(w)[:, 1]])  # rows 0..63, then 64..127
    np.testing.assert_array_equal(_np(quant.unblock(w)), kernel)
    np.testing.assert_allclose(_np(blocked_matmul(x, w)), _np(x) @ kernel, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ in the model
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            initializer_range=0.02)
IDS = jnp.asarray(np.array([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]], np.int32))
MASK = jnp.asarray((np.arange(7)[None] >= np.array([[2], [0]])).astype(np.int32))


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_quantized_base_built_or_quantized_scanned_or_not():
    """`CausalLM(cfg with quant)` = `quantize_base(CausalLM(cfg))` (each kernel drawn, then quantized); only the
    blocks' 7 projections are quantized (embedding, LM head, norms, biases as they were); the unrolled model
    computes what the scanned one does; `dequantize_base` gives a plain model with the same logits."""
    from rloo_jax.models import CausalLM, init_causal_lm
    from rloo_jax.models.lora import dequantize_base, quantize_base

    base = init_causal_lm(TINY, seed=0)
    for spec in (QuantSpec("int8"), QuantSpec("nf4", True)):  # every stored array kind between them
        q = quantize_base(base, spec)
        built = CausalLM(base.config.replace(quant=spec), nnx.Rngs(0))
        for a, b in zip(_leaves(q), _leaves(built), strict=True):
            np.testing.assert_array_equal(a, b)
        state = nnx.to_pure_dict(nnx.state(q))
        layer = state["model"]["layers"]
        stored = {"qkernel", "qscale"} | ({"qscale2"} if spec.double_quant else set())
        assert set(layer["mlp"]["down"]) == stored and set(layer["attn"]["q"]) == stored | {"bias"}
        assert set(state["lm_head"]) == {"kernel"} and set(state["model"]["embed"]) == {"embedding"}
        logits = np.asarray(q(IDS, MASK))
        plain = dequantize_base(q, "float32")
        assert plain.config.quant is None
        np.testing.assert_array_equal(np.asarray(plain(IDS, MASK)), logits)  # measured: equal on XLA:CPU
    unrolled = quantize_base(init_causal_lm(TINY, seed=0, scan_layers=False), spec)
    np.testing.assert_allclose(np.asarray(unrolled(IDS, MASK)), logits, atol=1e-6)  # measured: 0
    abstract = quantize_base(nnx.eval_shape(lambda: CausalLM(base.config, nnx.Rngs(0))), spec)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(abstract))] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(q))]


def test_quantized_kernels_shard_by_the_rule_table():
    """Codes [L, 64, din/64, dout] and scales [L, 1, din/64, dout] split as the kernel [L, din, dout] would: the
    block axis takes the input's mesh axis (fsdp for embed, tensor for mlp/heads), the output's its own; int8
    scales [L, 1, dout] only on the output's."""
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from rloo_jax import mesh as rmesh
    from rloo_jax.models import CausalLM, config_from_hf

    cfg = config_from_hf(dict(TINY, hidden_size=256, intermediate_size=512))
    mesh = AbstractMesh((1, 4, 2), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    for spec in (QuantSpec("nf4", True), QuantSpec("int8")):
        model = nnx.eval_shape(lambda s=spec: CausalLM(cfg.replace(quant=s), nnx.Rngs(0)))
        specs = nnx.to_pure_dict(jax.tree.map(lambda s: s.spec, rmesh.param_shardings(model, mesh)))["model"]
        up, down, k = specs["layers"]["mlp"]["up"], specs["layers"]["mlp"]["down"], specs["layers"]["attn"]["k"]
        if spec.kind == "nf4":  # up [2, 64, 4, 512]: embed on the 4 blocks, mlp; down [2, 64, 8, 256]: mlp, embed
            assert up["qkernel"] == up["qscale"] == P(None, None, "fsdp", "tensor")
            assert down["qkernel"] == down["qscale"] == P(None, None, "tensor", "fsdp")
            assert up["qscale2"] == P(None, None, "fsdp", "tensor")  # [2, 1, 4, 2]: 512 / 256 groups
            assert k["qkernel"] == P(None, None, "fsdp", "tensor")  # kv 128 over tensor 2
        else:
            assert up["qkernel"] == P(None, "fsdp", "tensor") and up["qscale"] == P(None, None, "tensor")
            assert down["qscale"] == P(None, None, "fsdp")



# ------------------------------------------------------------------------------------------------ one update step
def _step_config():
    import rloo_jax as rj
    from rloo_jax.sampling import SamplingConfig
    from rloo_jax.step import StepConfig

    sampling = SamplingConfig(max_new_tokens=6, num_generations=4, temperature=0.9, eos_token_ids=(3,),
                              pad_token_id=0)
    return StepConfig(sampling=sampling, algorithm=rj.RLOO(beta=0.1))


def _qlora(model, step=None):
    """(step, state) of randomised adapters (B != 0, so they act) on `model` as the frozen base, SGD lr 0.01 (the
    update is the gradient, scaled); `step`: one built for a model of the same structure (its compiled programs)."""
    import optax

    from rloo_jax.models import lora_spec
    from rloo_jax.models.lora import split_adapters, with_adapters
    from rloo_jax.programs import Programs

    model = nnx.merge(nnx.graphdef(model), jax.tree.map(jnp.copy, nnx.state(model)))  # update() donates the base
    graphdef, adapters, frozen = split_adapters(with_adapters(model, lora_spec("llama", 4, 8, 0.0, "all-linear"),
                                                              jax.random.key(1)))
    keys = iter(jax.random.split(jax.random.key(5), 64))
    adapters = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), adapters)
    step = step or Programs(graphdef, optax.sgd(1e-2), _step_config(), ref_graphdef=nnx.graphdef(model))
    return step, step.init_state(adapters, frozen=frozen)


def _update(step, state, ro, rewards):
    """The update on the completions of `ro`, their old and reference log-probs computed by this policy and base
    (one jitted program for the log-probs): (old log-probs, the adapters' update, scalar metrics)."""
    from rloo_jax.models.lora import merge_params
    from rloo_jax.programs import flat_metrics
    from rloo_jax.step import Rollout, completion_logps

    @jax.jit
    def logps(frozen, adapters):
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 0.9, 64)
        return (completion_logps(step.graphdef, merge_params(frozen, adapters), *args) * ro.completion_mask,
                completion_logps(step.ref_graphdef, frozen, *args) * ro.completion_mask)

    old, ref = logps(state.frozen, state.params)
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    rollout = Rollout(ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, ro.is_truncated, old, ref)
    state, metrics = step.update(state, rollout, rewards, jnp.ones((1,)))
    metrics = flat_metrics(metrics)
    delta = np.concatenate([(np.asarray(x) - b).ravel() for x, b in zip(jax.tree.leaves(state.params), before,
                                                                        strict=True)])
    return np.asarray(old), delta, {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


@pytest.mark.slow
def test_a_qlora_step_is_the_step_on_the_dequantized_base():
    """One LoRA update on an nf4 base = the same update on its dequantized weights held in float32 (the same math:
    measured equal to the last bit on XLA:CPU; the blocked matmul may sum in another order elsewhere), and
    differs from the update on the unquantized base by the quantization error, measured on this tiny random model
    (docs/lora.md): the completions' log-probs by up to 0.043 (their mean magnitude: 4.1), the update (the
    adapters' gradient: SGD) by 14.2% of its norm."""
    from rloo_jax.models import init_causal_lm
    from rloo_jax.models.lora import dequantize_base, quantize_base

    base = init_causal_lm(TINY, seed=0)
    q = quantize_base(base, QuantSpec("nf4"))
    parts = {"quantized": _qlora(q), "dequantized": _qlora(dequantize_base(q, "float32"))}
    parts["original"] = _qlora(base, parts["dequantized"][0])  # a plain base too: the same compiled step
    step, state = parts["quantized"]
    ro = step.rollout(state, IDS[:, 1:], MASK[:, 1:], jax.random.key(0))  # completions of the quantized policy
    rewards = jnp.asarray((np.asarray(ro.completion_ids) % 2 == 0).mean(1).astype(np.float32)[:, None])
    (oq, dq, mq), (od, dd, md), (oo, do, _) = (_update(*parts[n], ro, rewards) for n in parts)
    assert np.abs(oq - od).max() <= 1e-6 and np.abs(dq - dd).max() <= 1e-8
    assert all(abs(mq[k] - md[k]) <= 1e-6 for k in ("loss", "kl", "grad_norm"))
    mask = np.asarray(ro.completion_mask) > 0
    assert np.abs(oq - oo)[mask].max() == pytest.approx(0.0429, rel=0.01) and np.abs(oo[mask]).mean() > 4
    assert np.linalg.norm(dq - do) / np.linalg.norm(do) == pytest.approx(0.1422, rel=0.01)


# ------------------------------------------------------------------------------------------------ the trainer
def _logits(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))


@pytest.mark.slow
def test_cli_load_in_4bit_trains_and_exports(tmp_path):
    """--use_peft --load_in_4bit on the demo: the KL starts at 0 (the quantized base is the reference), the
    checkpoint holds the adapters only; final/ is a PEFT adapter folder for the unquantized base; final_merged/ is
    the dequantized base with the adapters folded in: the trained policy's logits (to 1e-5), and what
    `python -m rloo_jax.export --merged` writes from the checkpoint."""
    import transformers

    from rloo_jax.cli import main
    from rloo_jax.export import load_policy, read_checkpoint
    from rloo_jax.export import main as export_main
    from rloo_jax.models import load_causal_lm

    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2",
            "--use_peft", "--lora_target_modules", "all-linear", "--lora_r", "4", "--load_in_4bit",
            "--use_bnb_nested_quant", "--merge_adapter_on_export", "--eval_steps", "None", "--compilation_cache",
            "false"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and len(config["target_modules"]) == 7
    # the trained policy: the checkpoint's adapters on the base quantized as in training
    policy, _ = load_policy(read_checkpoint(str(out)))
    assert policy.config.quant == QuantSpec("nf4", True)
    ids = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = np.ones_like(ids)
    ours = _logits(policy, ids, mask)
    merged = out / "final_merged"
    assert np.abs(_logits(load_causal_lm(merged), ids, mask) - ours).max() <= 1e-5
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged)  # a plain Hugging Face folder
    assert hf.config.num_hidden_layers == policy.config.num_layers
    # the adapters on the unquantized base (what peft loads from final/): off by the 4-bit error, not more
    plain = _logits(load_causal_lm(out / "final"), ids, mask)
    assert 1e-4 < np.abs(plain - ours).max() < 0.5 * np.abs(ours).max()
    assert export_main([str(out), str(tmp_path / "merged"), "--merged"]) == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (merged / name).read_bytes(), name


@pytest.mark.parametrize(
    "args, message",
    [
        (["--load_in_4bit"], "load_in_4bit quantizes the frozen base of LoRA (QLoRA): pass --use_peft"),
        (["--load_in_8bit"], "load_in_8bit quantizes the frozen base of LoRA (QLoRA): pass --use_peft"),
        (["--use_peft", "--load_in_4bit", "--load_in_8bit"], "load_in_4bit and load_in_8bit both set"),
        (["--use_peft", "--use_bnb_nested_quant"], "use_bnb_nested_quant quantizes the scales of a 4-bit base"),
        (["--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "int4"], "bnb_4bit_quant_type: 'int4' is not one"),
    ],
)
def test_bad_quantization_options_exit_2_with_one_line(tmp_path, capsys, args, message):
    from rloo_jax.cli import main

    assert main(["--output_dir", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------------ on a TPU
def test_tpu_decodes_from_4bit_codes_at_their_floor():
    """Compiled for a v5e-4 with fsdp over its 4 chips: the codes take half a byte each in HBM (the arguments'
    size), a decode step gathers the 4-bit codes (not bf16 weights) over ICI and brings each stored byte and its
    KV caches to the chip's compute once: <= 1.2x the floor that counts codes at half a byte (measured 1.12x;
    the scan slices each layer's codes into on-chip memory, `hlo` counts the relayout it does in place as
    nothing). A bf16 base keeps its matrices where they lie and moves the step's 64 rows to them instead
    (`transformer.stationary_matmul`): measured 8.4% of its weights' bytes over ICI, where the FSDP gather moved
    3/4 of them (and the codes' gather moves 3/4 of their 4x fewer bytes)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.mesh import param_shardings, per_chip_bytes
    from rloo_jax.models.config import ModelConfig
    from rloo_jax.models.transformer import CausalLM, DecodeCache, PromptCache
    from rloo_jax.tpu import parse_slice, quiet_stderr, topology_devices

    layers, rows, heads, slots, dh, b, p, d, f = 4, 64, 8, 1024, 128, 8, 16, 1024, 2048
    mesh = Mesh(np.array(topology_devices(parse_slice("v5e-4"))).reshape(1, 4, 1), ("data", "fsdp", "tensor"))

    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    rows_spec = (None, ("data", "fsdp"))
    cache = DecodeCache(
        prompt=PromptCache(k=sds((layers, b, heads, p, dh), jnp.bfloat16, *rows_spec),
                           v=sds((layers, b, heads, p, dh), jnp.bfloat16, *rows_spec),
                           mask=sds((b, p), jnp.int32, rows_spec[1]), lengths=sds((b,), jnp.int32, rows_spec[1])),
        k=sds((layers, rows, heads, slots, dh), jnp.bfloat16, *rows_spec),
        v=sds((layers, rows, heads, slots, dh), jnp.bfloat16, *rows_spec))
    caches = per_chip_bytes(cache) - per_chip_bytes((cache.prompt.mask, cache.prompt.lengths))
    ici = {}
    for spec in (None, QuantSpec("nf4")):
        cfg = ModelConfig(family="llama", model_type="llama", vocab_size=256, hidden_size=d, num_layers=layers,
                          num_heads=heads, num_kv_heads=heads, head_dim=dh, intermediate_size=f, norm_eps=1e-5,
                          hidden_act="silu", rope_theta=1e4, rotary_dim=dh, dtype="bfloat16", param_dtype="bfloat16",
                          quant=spec)
        graphdef, params = nnx.split(nnx.eval_shape(lambda c=cfg: CausalLM(c, nnx.Rngs(0))))
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                              param_shardings(params, mesh))

        def step(params, tokens, i, cache, graphdef=graphdef):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return nnx.merge(graphdef, params).decode_step(tokens, i, cache)

        args = (params, sds((rows,), jnp.int32, ("data", "fsdp")), sds((), jnp.int32), cache)
        with quiet_stderr():
            compiled = jax.jit(step, donate_argnums=3).lower(*args).compile()
        assert compiled.memory_analysis().argument_size_in_bytes <= 1.01 * per_chip_bytes(args)
        cost = hlo.analyze(compiled.as_text()).total
        weights = sum(x.size * jax.dtypes.itemsize_bits(x.dtype) / 8 for x in jax.tree.leaves(params))  # gathered
        ici[spec] = cost.ici_bytes / weights
        if spec is not None:
            assert (cost.hbm_bytes + cost.ici_bytes) / (weights + caches) <= 1.2
            assert ici[spec] == pytest.approx(0.75, abs=0.05)  # 3 of 4 shards of the codes arrive
    assert 0 < ici[None] < 0.1  # the rows' exchanges, not the bf16 weights


def _abstract_nf4_llama(mesh, layers, d, heads, dh, f, **options):
    """An abstract nf4 Llama (bf16) with its parameters on `mesh`'s shardings, and the per-chip shapes of its
    stacked [L, ...] arrays (at least three kinds)."""
    from rloo_jax.mesh import param_shardings
    from rloo_jax.models.config import ModelConfig
    from rloo_jax.models.transformer import CausalLM

    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=256, hidden_size=d, num_layers=layers,
                      num_heads=heads, num_kv_heads=8, head_dim=dh, intermediate_size=f, norm_eps=1e-5,
                      hidden_act="silu", rope_theta=1e4, rotary_dim=dh, dtype="bfloat16", param_dtype="bfloat16",
                      quant=QuantSpec("nf4"), **options)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                          param_shardings(params, mesh))
    stacked = {x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(params) if x.ndim == 4}  # [L, ...] per chip
    assert len(stacked) >= 3
    return graphdef, params, stacked


@pytest.mark.slow
def test_tpu_decode_loop_reads_the_stored_codes_in_place():
    """The decode loop multiplies each layer's codes as they are stored: no copy of a stacked [L, ...] array of the
    base before the loop (Session 9: stored [din/K, K, dout], the TPU compiler relayouted the whole stacked base to
    [L, K, din/K, dout] before every loop that multiplied it, 4.9 GB per chip of Llama-3.1-70B on a v5e-8, twice in
    the rollout). Compiled for a v5e-4, fsdp over its 4 chips, a loop of decode steps of a 4-layer nf4 model."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.models.attention import compile_target
    from rloo_jax.models.transformer import DecodeCache, PromptCache
    from rloo_jax.tpu import parse_slice, quiet_stderr, topology_devices

    # Llama-3.1-8B's widths: at 2048 x 8192 (and on a v5e-4) the compiler kept every stack in place, old storage too
    layers, rows, heads, slots, dh, p, d, f = 4, 64, 32, 256, 128, 64, 4096, 14336
    mesh = Mesh(np.array(topology_devices(parse_slice("v5e-8"))).reshape(1, 8, 1), ("data", "fsdp", "tensor"))

    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    rs = (None, ("data", "fsdp"))
    kv = [sds((layers, rows, 8, n, dh), jnp.bfloat16, *rs) for n in (p, p, slots, slots)]
    cache = DecodeCache(prompt=PromptCache(k=kv[0], v=kv[1], mask=sds((rows, p), jnp.int32, rs[1]),
                                           lengths=sds((rows,), jnp.int32, rs[1])), k=kv[2], v=kv[3])
    graphdef, params, stacked = _abstract_nf4_llama(mesh, layers, d, heads, dh, f)

    def loop(params, tokens, cache):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            model = nnx.merge(graphdef, params)

            def body(i, carry):
                logits, cache = model.decode_step(carry[0], i, carry[1])
                return jnp.argmax(logits, -1).astype(jnp.int32).reshape(rows), cache

            return jax.lax.fori_loop(0, 8, body, (tokens, cache))

    with quiet_stderr(), compile_target("tpu"):  # the TPU's attention kernels, as the trainer compiles
        text = jax.jit(loop, donate_argnums=2).lower(params, sds((rows,), jnp.int32, rs[1]), cache).compile().as_text()
    # (a stack small enough for on-chip VMEM may be staged there whole, `S(1)`: no HBM)
    copies = [i.shape for i in hlo.parse(text)["ENTRY"]
              if i.opcode == "copy" and i.shape in stacked and any(space == 0 for _, space in i.leaves)]
    assert copies == []


@pytest.mark.slow
def test_tpu_logprob_loop_reads_the_stored_codes_in_place():
    """The rollout's log-prob passes (`Step.finish`: a loop over micro-batches around the layers' scan) multiply
    each layer's codes where they are stored: no copy of a stacked [L, ...] array of the base before the loop.
    Left free, the TPU compiler met the layout its matmul over many rows asks for ([din/K, K, dout]) by relayouting
    the whole stacked codes before the loop (Session 11: 2.1 GB per chip of Llama-3.1-70B on a v5e-16, live
    through the decode loop); `transformer._codes` pins the stored layout and relayouts one gathered layer at a
    time. Compiled for a v5e-8, fsdp over its 8 chips, 4 nf4 layers at Llama-3.1-8B widths, 2 micro-batches."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.models.attention import compile_target
    from rloo_jax.step import completion_logps
    from rloo_jax.tpu import parse_slice, quiet_stderr, topology_devices

    # at Llama-3.1-8B's widths the compiler copied q, k, v, o, gate and up (old code: 6 copies)
    layers, micro, prompts, g, p, c, d, f = 4, 2, 8, 8, 64, 128, 4096, 14336
    mesh = Mesh(np.array(topology_devices(parse_slice("v5e-8"))).reshape(1, 8, 1), ("data", "fsdp", "tensor"))

    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    graphdef, params, stacked = _abstract_nf4_llama(mesh, layers, d, d // 128, 128, f, attn_implementation="splash")

    def passes(params, prompt_ids, completion_ids):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            def forward(i):
                return completion_logps(graphdef, params, prompt_ids[i], jnp.ones_like(prompt_ids[i]),
                                        completion_ids[i], jnp.ones_like(completion_ids[i]), 1.0)

            return jax.lax.map(forward, jnp.arange(micro))

    rows = (None, ("data", "fsdp"))
    args = (params, sds((micro, prompts, p), jnp.int32, *rows), sds((micro, prompts * g, c), jnp.int32, *rows))
    with quiet_stderr(), compile_target("tpu"):  # the TPU's attention kernels and layouts, as the trainer compiles
        text = jax.jit(passes).lower(*args).compile().as_text()
    copies = [i.shape for i in hlo.parse(text)["ENTRY"]
              if i.opcode == "copy" and i.shape in stacked and any(space == 0 for _, space in i.leaves)]
    assert copies == []
