"""LoRA and QLoRA on a mixture of experts' experts: adapters on the fused expert parameters as peft's
`target_parameters` puts them (our logits = peft + transformers' on the saved folder; merged = W + scale A B), and
the experts stored 4-bit under --load_in_4bit (within NF4's error bound; the 4-bit forward = the dequantized
model's exactly; memory accounting; the CLI trains it; compile-only covers it)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from rloo_jax import quant
from rloo_jax.cli import main
from rloo_jax.efficiency import Transformer
from rloo_jax.export import load_policy, read_checkpoint
from rloo_jax.given import lora_options
from rloo_jax.models import ModelLoadError, load_adapter, load_causal_lm, lora_spec, moe, save_adapter, save_pretrained
from rloo_jax.models.loaded import convert_peft
from rloo_jax.models.lora import dequantize_base, merge_adapters, quantize_base, split_adapters, with_adapters
from rloo_jax.quant import QuantSpec
from tests.checkpoints import PAD_ID, build_gpt_oss, build_qwen3_moe
from tests.fixtures_models import tiny_checkpoint  # noqa: F401
from tests.test_compile_only import common, config_only_model, run_main
from tests.test_expert_parallel import TINY_QWEN3_MOE, _pairs
from tests.xla_flags import result_on_devices

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
IDS = np.array([[0, 0, 0, 17, 90, 41, 5], [5, 210, 33, 8, 150, 77, 64]], np.int32)
MASK = (IDS != PAD_ID).astype(np.int32)
TOL = 2e-5  # float32 logits against peft + transformers; measured 2.0e-6 (Qwen3-MoE), 8.9e-6 (GPT-OSS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_lora")
    return {"qwen3_moe": build_qwen3_moe(root / "qwen3_moe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
            "gpt_oss": build_gpt_oss(root / "gpt_oss")}


def _logits(model):
    return np.asarray(jax.jit(lambda m: m(jnp.asarray(IDS), jnp.asarray(MASK)))(model))


def _hf_logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS).long(), attention_mask=torch.tensor(MASK).long()).logits.numpy()


def _randomised(model, std=0.3):
    """Every adapter weight random (B too), so a transposed or misplaced expert's adapter shows up."""
    graphdef, adapters, base = split_adapters(model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), base)


def _expert_lora(rs, e, d, f, r=2):
    """Random adapters for `moe.experts_apply`: gate and up share A [E, D, r] (gate_up_proj's), down its own."""
    draw = lambda *shape: jnp.asarray(rs.randn(*shape), jnp.float32)  # noqa: E731
    a = draw(e, d, r)
    return (a, draw(e, r, f)), (a, draw(e, r, f)), (draw(e, f, r), draw(e, r, d))


def test_experts_apply_with_adapters_is_the_merged_experts():
    """The adapters' two ragged_dots per projection = the experts W_e + scale A_e B_e (merged as peft merges), and
    each shard's share (`first`) adds up to the whole; zero B adds exactly nothing."""
    rs, (t, d, e, f, k), x, experts, w, (gate, up, down) = _pairs(2)
    lora = _expert_lora(rs, e, d, f)
    merged = [wt + 0.5 * jnp.einsum("eir,ero->eio", a, b) for wt, (a, b) in zip((gate, up, down), lora, strict=True)]
    got = moe.experts_apply(x, experts, w, gate, up, down, lora=lora, lora_scale=0.5)
    np.testing.assert_allclose(got, moe.experts_apply(x, experts, w, *merged), atol=1e-5)
    assert np.abs(np.asarray(got - moe.experts_apply(x, experts, w, gate, up, down))).max() > 0.1
    halves = [moe.experts_apply(x, experts, w, gate[i:i + 2], up[i:i + 2], down[i:i + 2], first=i,
                                lora=jax.tree.map(lambda v, i=i: v[i:i + 2], lora), lora_scale=0.5) for i in (0, 2)]
    np.testing.assert_allclose(halves[0] + halves[1], got, atol=1e-5)
    zero = jax.tree.map(lambda v: v * 0, lora)
    np.testing.assert_array_equal(moe.experts_apply(x, experts, w, gate, up, down, lora=zero, lora_scale=0.5),
                                  moe.experts_apply(x, experts, w, gate, up, down))


SHARDED = r'''
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from rloo_jax import mesh as M
from rloo_jax.models import moe
from tests.test_expert_parallel import _pairs
from tests.test_moe_lora import _expert_lora
rs, (t, d, e, f, k), x, experts, w, weights = _pairs(3)
lora = _expert_lora(rs, e, d, f)
mesh = M.make_mesh(1, -1, 1, expert_parallel=4)  # 4 devices: fsdp 1, expert 4

def loss(x, lora, fixed):
    experts, w, (gate, up, down) = fixed
    y = moe.experts_apply_sharded(x[None], experts[None], w[None], gate, up, down, lora=lora, lora_scale=0.5)
    return jnp.sum(jnp.sin(y))

def on_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.value_and_grad(loss, argnums=(0, 1))(*args)

args = (x, lora, (experts, w, weights))
one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)
four = jax.jit(on_mesh)(*jax.device_put(args, NamedSharding(mesh, P())))
diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True))
print("RESULT " + json.dumps({"diff": diff, "scale": float(max(jnp.abs(a).max() for a in jax.tree.leaves(one)))}))
'''


def test_expert_adapters_split_over_the_expert_axis_as_the_experts():
    """`experts_apply_sharded` with adapters on a 4-way expert mesh (forced CPU devices; each shard holds its
    experts' A and B): the loss and the gradients for x and every adapter equal one device's."""
    result = result_on_devices(SHARDED, 4, timeout=300)
    print(result)
    assert result["diff"] <= 1e-5 * max(1.0, result["scale"])


def test_expert_targets_resolve_as_peft_matches_them():
    spec = lora_spec("llama", 4, 8, 0.0, [], False, ["experts.down_proj", "mlp.experts.gate_up_proj", "down_proj"])
    assert spec.target_parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert spec.experts == {"down", "gate_up"} and spec.modules == set() and spec.scale == 2.0
    assert lora_spec("llama", 4, 8).experts == frozenset()  # the default: attention only, as before
    with pytest.raises(ModelLoadError, match="mlp.gate_proj is not an expert parameter; choose from "
                                             "mlp.experts.gate_up_proj, mlp.experts.down_proj"):
        lora_spec("llama", 4, 8, 0.0, None, False, ["mlp.gate_proj"])
    with pytest.raises(ModelLoadError, match="lora_target_parameters needs lora_dropout 0 \\(got 0.05\\)"):
        lora_spec("llama", 4, 8, 0.05, None, False, EXPERTS)
    # TRL's trainer API: a peft LoraConfig with target_parameters
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
                             target_parameters=EXPERTS)
    assert lora_options(config)["lora_target_parameters"] == EXPERTS


@pytest.mark.parity
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_expert_adapters_load_in_peft_with_our_logits(checkpoints, tmp_path, name):
    """Zero adapters (B = 0) give the base's logits exactly; random ones, saved as a PEFT folder, give peft's
    logits on transformers' model (its ParamWrapper's per-expert A [E * r, in], B [out, r * E]); the folder reloads
    bit for bit, in the unrolled layout too; merged, transformers loads the adapted model."""
    path = checkpoints[name]
    base = load_causal_lm(path)
    experts_only = with_adapters(base, lora_spec("llama", 4, 8, 0.0, [], False, EXPERTS), jax.random.key(0))
    np.testing.assert_array_equal(_logits(experts_only), _logits(base))

    spec = lora_spec("llama", 4, 8, 0.0, ["q_proj", "o_proj"], True, EXPERTS)
    model = _randomised(with_adapters(base, spec, jax.random.key(0)))
    ours = _logits(model)
    out = save_adapter(model, tmp_path / "adapter", str(path))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == EXPERTS and config["lora_dropout"] == 0.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf, out).eval()
    theirs = _hf_logits(peft_model)
    diff = np.abs(ours - theirs)[MASK == 1].max()
    moved = np.abs(ours - _logits(base))[MASK == 1].max()
    print(f"{name}: peft vs ours max abs diff {diff:.2e} (adapters move the logits by {moved:.2e})")
    assert diff <= TOL and moved > 1e-1

    # a PeftModel given to the trainer: its base (wrapped twice per layer) and adapters, its options
    converted, options = convert_peft(peft_model)
    assert options["lora_target_parameters"] == sorted(EXPERTS) and options["lora_target_modules"] == ["o_proj",
                                                                                                      "q_proj"]
    assert np.abs(_logits(converted) - ours).max() <= 1e-5

    again = load_adapter(out)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    unrolled = load_adapter(out, scan_layers=False)
    assert np.abs(_logits(unrolled) - ours).max() <= 1e-5

    merged = save_pretrained(merge_adapters(model), tmp_path / "merged")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    assert np.abs(_hf_logits(hf_merged) - ours)[MASK == 1].max() <= TOL


def test_experts_quantize_within_nf4_s_bound_and_compute_as_dequantized(checkpoints):
    """Each expert's [din, dout] quantized as a kernel: every weight within half the widest NF4 gap of its block's
    absmax; the 4-bit model's forward = the forward of its dequantization, exactly; with expert adapters too."""
    base = load_causal_lm(checkpoints["qwen3_moe"])
    spec = QuantSpec("nf4")
    q = quantize_base(base, spec)
    layer = q.model.layers.mlp
    assert layer.experts_gate is None and layer.experts_gate_codes[...].dtype == jnp.uint4
    assert layer.experts_gate_codes[...].shape == (2, 4, 32, 1, 16)  # [L, E, K, D / K, F]: D 32 in one block
    half_gap = float(np.max(np.diff(quant.codebook("nf4")))) / 2
    plain = dequantize_base(q)
    for name in ("gate", "up", "down"):
        w = np.asarray(getattr(base.model.layers.mlp, f"experts_{name}")[...])  # [L, E, din, dout]
        wq = np.asarray(getattr(plain.model.layers.mlp, f"experts_{name}")[...])
        k = quant.block_size(w.shape[-2])
        absmax = np.abs(w.reshape(*w.shape[:2], -1, k, w.shape[-1])).max(axis=-2, keepdims=True)
        err = np.abs(w - wq).reshape(*w.shape[:2], -1, k, w.shape[-1])
        assert (err <= absmax * half_gap * (1 + 1e-6)).all() and err.max() > 0
    np.testing.assert_array_equal(_logits(q), _logits(plain))

    lora = _randomised(with_adapters(q, lora_spec("llama", 4, 8, 0.0, [], False, EXPERTS), jax.random.key(0)))
    np.testing.assert_array_equal(_logits(lora), _logits(dequantize_base(lora)))
    assert np.abs(_logits(merge_adapters(lora)) - _logits(lora)).max() <= 1e-5


QUANT_FSDP_WORKER = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from rloo_jax import mesh as M
from rloo_jax.models import load_causal_lm, moe
from rloo_jax.models.lora import quantize_base
from rloo_jax.quant import QuantSpec
from tests.xla_flags import largest_all_gather

q = quantize_base(load_causal_lm("PATH"), QuantSpec("nf4"))
rs = np.random.RandomState(0)
ids = jnp.asarray(rs.randint(3, 200, (4, 7)), jnp.int32)
mask = jnp.ones((4, 7), jnp.int32).at[0, :3].set(0)  # a left-padded row
forward = lambda g, p, r: nnx.merge(g, p, r)(ids, mask)  # noqa: E731
graphdef, params, rest = nnx.split(q, nnx.Param, ...)
ref = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, params, rest))  # one device
sharded, moves = moe.experts_apply_sharded, []
def spy(*args, **kwargs):  # which path the quantized experts took
    moves.append(kwargs.get("moves"))
    return sharded(*args, **kwargs)
moe.experts_apply_sharded = spy
mesh = M.make_mesh(1, 4, 1, devices=jax.devices())
with jax.set_mesh(mesh):
    placed = M.shard_params(params, M.param_shardings(params, mesh))
    out = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, placed, rest))
    text = jax.jit(forward, static_argnums=0).lower(graphdef, placed, rest).compile().as_text()
codes = placed["model"]["layers"]["mlp"]["experts_gate_codes"][...]
print("RESULT " + json.dumps({"diff": float(np.abs(out - ref).max()), "moves": moves,
                              "gathered": largest_all_gather(text),
                              "codes split": str(codes.sharding.spec), "scale": float(np.abs(ref).max())}))
'''


def test_quantized_experts_stay_split_on_fsdp_where_the_rows_move(tmp_path):
    """A 4-bit Qwen3-MoE (D 256: four 64-row blocks of each expert's codes, one a device of fsdp 4) on 4 host
    devices: 4 rows x 7 tokens (56 pairs) move to the experts (`moe.moving_rows` at the codes' bytes), each
    device dequantizes its own blocks (the codes stay split over fsdp), the 28 rows move to the LM head too
    (`Transformer.unembed`: no all-gather of its [256, 288]), and the logits are one device's (float32, the sums
    in another order: measured 8.6e-6 of logits up to 10.2, 8.5e-7 relative)."""
    path = build_qwen3_moe(tmp_path / "moe", hidden_size=256, num_experts=4, num_experts_per_tok=2,
                           norm_topk_prob=True)
    result = result_on_devices(QUANT_FSDP_WORKER.replace("PATH", str(path)), 4)
    assert result["moves"] and all(m is True for m in result["moves"]), result
    assert "fsdp" in result["codes split"], result
    assert 0 < result["gathered"] < 256 * 288, result  # some weights (8,192), not the LM head (gathered before)
    assert result["diff"] <= 2e-6 * result["scale"], result  # NaN fails


def test_memory_accounting_counts_the_experts_as_stored():
    """`efficiency.Transformer.weight_bytes` of a quantized mixture of experts: attention and every expert at
    their NF4 bytes, the router and the unembedding at the compute dtype's."""
    from rloo_jax.models import config_from_hf

    cfg = config_from_hf(TINY_QWEN3_MOE)
    spec = QuantSpec("nf4")
    d, f, e, v = 64, 32, 8, 160
    attention = sum(quant.stored_bytes(i, o, spec) for i, o in ((d, 64), (d, 32), (d, 32), (64, d)))
    expert = 2 * quant.stored_bytes(d, f, spec) + quant.stored_bytes(f, d, spec)
    want = 2 * (attention + e * expert) + 2 * (2 * d * e + d * v)
    assert Transformer.of(cfg, spec).weight_bytes(2) == pytest.approx(want)
    assert Transformer.of(cfg, spec).weight_bytes(2) < 0.4 * Transformer.of(cfg).weight_bytes(2)


@pytest.mark.slow
def test_cli_trains_a_4bit_mixture_of_experts_with_expert_adapters(checkpoints, tmp_path, tiny_checkpoint):  # noqa: F811
    """--use_peft --lora_target_parameters --load_in_4bit on a tiny Qwen3-MoE, 2 steps: the KL starts at 0 (the
    4-bit base is the reference), final/ is a PEFT folder with the experts' adapters, which have moved; the
    checkpoint is the policy (its adapters on the base quantized again) and final_merged/ its merge; a third step
    resumes it (the layout check knows the expert targets)."""
    model = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_moe"], model)
    for f in tiny_checkpoint("tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    data = tmp_path / "prompts.jsonl"
    # a byte-level tokenizer's random completions: half the printable characters (every other one) score
    letters = ["".join(chr(c) for c in range(32, 127) if (c + i) % 2 == 0) for i in range(2)]
    data.write_text("".join(json.dumps({"prompt": f"spell {i} with", "letters": letters[i % 2]}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--reward_funcs",
            "rloo_jax.demo:letters_reward", "--scan_layers", "true",
            "--output_dir", str(out), "--num_generations", "4", "--per_device_train_batch_size", "8",
            "--max_prompt_length", "8", "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1",
            "--save_steps", "2", "--compilation_cache", "false", "--beta", "0.04", "--learning_rate", "0.05",
            "--use_peft", "--lora_r", "2", "--lora_dropout", "0", "--lora_target_parameters",
            "mlp.experts.gate_up_proj,mlp.experts.down_proj", "--load_in_4bit", "--merge_adapter_on_export"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[0]["reward_std"] > 0
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(EXPERTS) and config["target_modules"] == ["q_proj", "v_proj"]
    from safetensors.numpy import load_file

    tensors = load_file(out / "final" / "adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"]  # down_proj's: [D, r * E]
    assert b.shape == (32, 2 * 4) and np.abs(b).max() > 0  # B starts at 0: trained

    policy, _ = load_policy(read_checkpoint(str(out)))
    assert policy.config.quant == QuantSpec("nf4") and policy.config.lora.experts == {"gate_up", "down"}
    np.testing.assert_array_equal(np.asarray(policy.model.layers.mlp.experts_down_lora_b[...][0]),
                                  b.reshape(32, 2, 4).transpose(2, 1, 0))
    # x (W + s A B) against x W + s (x A) B in float32, logits of magnitude ~2: measured 1.4e-5
    assert np.abs(_logits(load_causal_lm(out / "final_merged")) - _logits(policy)).max() <= 5e-5
    assert main([*args[:args.index("--max_steps") + 1], "3", *args[args.index("--max_steps") + 2:]]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_compile_only_covers_a_4bit_mixture_of_experts_with_expert_adapters(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """--compile_only builds the quantized experts and their adapters abstractly and compiles them for a v5e-4 with
    the experts split 4 ways (codes, scales and adapters on the expert axis)."""
    model = config_only_model(tmp_path, TINY_QWEN3_MOE, tiny_checkpoint("tokenizer"))
    code, _, err = run_main(capsys, common(tmp_path, model) + [
        "--topology", "v5e-4", "--expert_parallel", "4", "--use_peft", "--lora_r", "4", "--lora_dropout", "0",
        "--lora_target_parameters", "mlp.experts.gate_up_proj,mlp.experts.down_proj", "--load_in_4bit"])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    assert report["fits"] and set(report["programs"]) >= {"rollout", "update"}
    # q_proj, v_proj [(64 + 64) + (64 + 32)] x r 4, and per expert gate_up (64 + 2 x 32) + down (32 + 64) x r 4
    assert report["settings"]["trainable_params"] == 2 * 4 * ((64 + 64) + (64 + 32) + 8 * ((64 + 64) + (32 + 64)))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--use_peft", "--lora_target_parameters", "mlp.experts.down_proj"],
         "lora_target_parameters needs lora_dropout 0 (got 0.05; TRL's default is 0.05)"),
        (["--use_peft", "--lora_dropout", "0", "--lora_target_parameters", "mlp.experts.down_proj"],
         "a qwen2 model has no experts"),  # the built-in demo model: dense
    ],
)
def test_bad_expert_targets_exit_2_with_one_line(tmp_path, capsys, args, message):
    assert main(["--output_dir", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
