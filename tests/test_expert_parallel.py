"""Expert parallelism (issue 37): a Qwen3-MoE policy on a mesh with an `expert` axis of 4 over 8 host CPU devices
(data 1, fsdp 2, expert 4, tensor 1) trains and samples as on one device.

As tests/test_mesh.py: everything that needs 8 devices runs in one subprocess (``XLA_FLAGS`` must be set before jax
is imported), which prints one JSON line; the checkpoint is built here (tests/checkpoints.build_qwen3_moe: 8 experts,
top-2, renormalised, both layers routed) and loaded there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from rloo_jax import mesh as rmesh
from rloo_jax.build import check_expert_parallel
from rloo_jax.cli import config_from_dict
from rloo_jax.errors import ConfigError
from rloo_jax.models import config_from_hf, moe
from tests.checkpoints import build_qwen3_moe
from tests.fixtures_models import tiny_checkpoint  # noqa: F401
from tests.test_compile_only import common, config_only_model, run_main
from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 400
MOE_DICT = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 32,
            "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}

WORKER = r'''
import dataclasses, json, os, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import rloo_jax as rj
from rloo_jax import mesh as M
from rloo_jax.models import load_causal_lm
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.sampling import SamplingConfig, generate_fn
from rloo_jax.step import Step, StepConfig
from tests.diffs import tree_max_abs_diff

PATH = os.environ["MOE_PATH"]
G, C = 2, 6
IDS = np.array([[0, 0, 17, 90, 41, 5], [5, 210, 33, 8, 150, 77], [0, 120, 9, 250, 31, 3], [7, 8, 9, 10, 11, 12]],
               np.int32)
MASK = (IDS != 0).astype(np.int32)
SAMPLING = SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9, eos_token_ids=(2,), pad_token_id=0)
CFG = StepConfig(sampling=SAMPLING, algorithm=rj.RLOO(beta=0.1), steps_per_generation=2,
                 gradient_accumulation_steps=2, recompute_old_logps=True, routes=(2, 2))
MESH = M.make_mesh(1, -1, 1, expert_parallel=4)  # (data 1, fsdp 2, expert 4, tensor 1)

def copy(t):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), t)

def rewards_of(ids):
    return ((ids % 2 == 0).mean(1).astype(np.float32)[:, None])

def scenario(mesh):
    """rollout (sampled, routes recorded) -> host rewards -> one SGD update, with routing replay."""
    graphdef, params = nnx.split(load_causal_lm(PATH))
    step = Programs(graphdef, optax.sgd(0.5), CFG, mesh=mesh)
    ref = jax.tree.map(lambda x: x + 0.01, copy(params))  # reference != policy: the KL is not 0
    state = step.init_state(copy(params), ref)
    key, w, ids, mask = jax.random.key(7), np.ones((1,), np.float32), IDS, MASK
    if mesh is not None:
        ids, mask = M.host_local_batch_to_global(IDS, mesh), M.host_local_batch_to_global(MASK, mesh)
        key, w = M.replicate(key, mesh), M.replicate(w, mesh)
    ro = step.rollout(state, ids, mask, key)
    completions = M.local_rows(ro.completion_ids)
    r = rewards_of(completions)
    rewards = r if mesh is None else M.host_local_batch_to_global(r, mesh)
    step.compile_update(ids.shape, 1)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    new, metrics = step.update(state, ro, rewards, w)
    jax.block_until_ready(new)
    jax.monitoring.unregister_event_duration_listener(listener)
    metrics = flat_metrics(metrics)
    return {"completions": completions.tolist(), "old_logps": M.local_rows(ro.old_logps).tolist(),
            "sampler_logps": M.local_rows(ro.sampler_logps).tolist(),
            "mask": M.local_rows(ro.completion_mask).tolist(),
            "metrics": {k: float(v) for k, v in metrics.items()}, "update_compiles": len(compiles),
            "routes": np.asarray(M.local_rows(ro.routes.completion)).tolist()}, new, ro, rewards

out = {"mesh": {k: int(v) for k, v in MESH.shape.items()}}
single, s_state, ro, rewards = scenario(None)
sharded, m_state, _, _ = scenario(MESH)
out["single"], out["sharded"] = single, sharded
out["param_max_diff"] = tree_max_abs_diff(s_state.params, m_state.params, "params, one device vs the mesh")
g = m_state.params["model"]["layers"]["mlp"]["experts_gate"][...]  # [L 2, E 8, D 32, F 16]
out["experts_gate"] = {"shape": list(g.shape), "shard": list(g.addressable_shards[0].data.shape),
                       "spec": str(g.sharding.spec)}

# the update's loss and gradients of one micro-batch (the rollout's first 4 rows, its routes replayed), one device
# vs traced on the expert-parallel mesh with sharded parameters and rows
graphdef, params = nnx.split(load_causal_lm(PATH))
step = Step(graphdef, optax.sgd(0.0), dataclasses.replace(CFG, gradient_accumulation_steps=1))  # off policy: old fixed
n = 4
mb = {"prompt_ids": jnp.asarray(IDS[:n // G]), "prompt_mask": jnp.asarray(MASK[:n // G]),
      "completion_ids": ro.completion_ids[:n], "mask": ro.completion_mask[:n], "old_logps": ro.old_logps[:n] * 1.03,
      "ref_logps": ro.old_logps[:n] + 0.01, "advantages": jnp.asarray([0.1, -0.1, 0.05, -0.05]),
      "prompt_routes": ro.routes.prompt[:n // G], "routes": ro.routes.completion[:n]}

def loss_fn(p, mb):
    return step.loss(p, None, mb, None, None, jnp.float32(mb["mask"].sum()))[0]

vg = jax.jit(jax.value_and_grad(loss_fn))
l1, gr1 = vg(params, mb)

def on_mesh(p, mb):
    with jax.sharding.use_abstract_mesh(MESH.abstract_mesh):
        return jax.value_and_grad(loss_fn)(p, mb)

sp = M.shard_params(params, M.param_shardings(params, MESH))
put = lambda x: jax.device_put(x, M.batch_sharding(MESH, x.shape))
l8, gr8 = jax.jit(on_mesh)(sp, jax.tree.map(put, mb))
out["loss"] = [float(l1), float(l8)]
out["grad_max_diff"] = tree_max_abs_diff(gr1, gr8, "gradients, one device vs the mesh")
out["grad_norm"] = float(optax.global_norm(gr1))
out["grad_max_abs"] = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gr1))
FSDP = M.make_mesh(1, -1, 1)  # the same devices without expert parallelism: the reduction-order baseline

def on_fsdp(p, mb):
    with jax.sharding.use_abstract_mesh(FSDP.abstract_mesh):
        return jax.value_and_grad(loss_fn)(p, mb)

put = lambda x: jax.device_put(x, M.batch_sharding(FSDP, x.shape))
_, grf = jax.jit(on_fsdp)(M.shard_params(params, M.param_shardings(params, FSDP)), jax.tree.map(put, mb))
out["fsdp_grad_max_diff"] = tree_max_abs_diff(gr1, grf, "gradients, one device vs fsdp 8")
jaxpr = str(jax.make_jaxpr(on_mesh)(sp, mb))
out["shard_map_in_update"] = "shard_map" in jaxpr and "psum" in jaxpr

# greedy decoding on the expert-parallel mesh == one device
greedy = dataclasses.replace(SAMPLING, temperature=0.0)
gen = jax.jit(generate_fn, static_argnums=(0, 5, 6))
one = gen(graphdef, params, IDS, MASK, jax.random.key(0), greedy, None)
on_mesh_gen = gen(graphdef, sp, M.host_local_batch_to_global(IDS, MESH), M.host_local_batch_to_global(MASK, MESH),
                  M.replicate(jax.random.key(0), MESH), greedy, MESH)
out["greedy"] = [np.asarray(one.completion_ids).tolist(), M.local_rows(on_mesh_gen.completion_ids).tolist()]
out["greedy_logps_max_diff"] = float(np.abs(np.asarray(one.logps) - M.local_rows(on_mesh_gen.logps)).max())
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def compare(tmp_path_factory) -> dict:
    path = build_qwen3_moe(tmp_path_factory.mktemp("moe"), num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    env = dict(os.environ, XLA_FLAGS=forced_devices(8), JAX_PLATFORMS="cpu", MOE_PATH=str(path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-5000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, p.stdout[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps({k: result[k] for k in ("loss", "grad_max_diff", "grad_norm", "grad_max_abs",
                                             "fsdp_grad_max_diff", "param_max_diff",
                                             "greedy_logps_max_diff")}))
    return result


# ------------------------------------------------------------------------------------------- in this process
def test_rule_table_splits_experts_over_the_expert_axis():
    """`expert` -> the expert axis where the mesh has one (fsdp still on embed), then `tensor` where it divides the
    experts too: a tensor shard holds whole experts and their F is not split (tensor 1 splits nothing)."""
    ep = AbstractMesh((1, 2, 4, 1), rmesh.EXPERT_MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    plain = AbstractMesh((1, 2, 2), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    gate = ("layers", "expert", "embed", "mlp")
    assert rmesh.fit_spec(gate, (2, 8, 32, 16), ep) == PartitionSpec(None, ("expert", "tensor"), "fsdp")
    assert rmesh.fit_spec(gate, (2, 6, 32, 16), ep) == PartitionSpec(None, None, "fsdp", "tensor")  # 4 !| 6
    assert rmesh.fit_spec(gate, (2, 8, 32, 16), plain) == PartitionSpec(None, "tensor", "fsdp")  # 4 experts a shard
    assert rmesh.fit_spec(gate, (2, 5, 32, 16), plain) == PartitionSpec(None, None, "fsdp", "tensor")  # 2 !| 5: F
    # no rows over the expert axis
    assert rmesh.fit_spec(("batch", None), (8, 3), ep) == PartitionSpec(("data", "fsdp"))


def _pairs(seed: int) -> tuple:
    """5 tokens, each routed to 2 of 4 experts (D 4, F 3), random inputs, gate weights and expert weights."""
    rs = np.random.RandomState(seed)
    t, d, e, f, k = 5, 4, 4, 3, 2
    x = jnp.asarray(rs.randn(t, d), jnp.float32)
    experts = jnp.asarray([[0, 3], [1, 2], [3, 2], [0, 1], [2, 0]], jnp.int32)
    w = jnp.asarray(rs.rand(t, k), jnp.float32)
    weights = tuple(jnp.asarray(rs.randn(*s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    return rs, (t, d, e, f, k), x, experts, w, weights


def test_experts_apply_of_a_shard_is_its_experts_share():
    """`experts_apply` with `first`: the pairs of the experts a shard holds; the shards' sum is the whole sum, and
    `first` 0 over all experts is `experts_apply` as before (bit for bit)."""
    rs, (t, d, e, f, k), x, experts, w, (gate, up, down) = _pairs(0)
    whole = moe.experts_apply(x, experts, w, gate, up, down)
    halves = [moe.experts_apply(x, experts, w, gate[i:i + 2], up[i:i + 2], down[i:i + 2], first=i) for i in (0, 2)]
    np.testing.assert_allclose(halves[0] + halves[1], whole, atol=1e-6)

    def one(tk: int) -> np.ndarray:  # one pair by hand
        ex = int(experts.reshape(-1)[tk])
        h = jax.nn.silu(x[tk // k] @ gate[ex]) * (x[tk // k] @ up[ex])
        return np.asarray(w.reshape(-1)[tk] * (h @ down[ex]))

    np.testing.assert_allclose(halves[1][0], one(1), atol=1e-6)  # token 0: expert 3 only on shard 1
    np.testing.assert_allclose(halves[0][1], one(2), atol=1e-6)  # token 1: expert 1 only on shard 0
    unsharded = moe.experts_apply_sharded(x[None], experts[None], w[None], gate, up, down)[0]  # no mesh
    np.testing.assert_array_equal(unsharded, whole)


def test_make_mesh_with_an_expert_axis_and_its_errors():
    mesh = rmesh.make_mesh(1, -1, 1, devices=jax.devices()[:1], expert_parallel=1)
    assert mesh.axis_names == rmesh.MESH_AXES  # size 1: the mesh every run had
    with pytest.raises(ValueError, match="expert_parallel=2"):
        rmesh.make_mesh(1, 1, 1, devices=jax.devices()[:1], expert_parallel=2)
    with pytest.raises(ValueError, match="positive"):
        rmesh.make_mesh(1, 1, 1, devices=jax.devices()[:1], expert_parallel=0)


def _config(**kw):
    values = {"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["pkg.mod:f"], **kw}
    return config_from_dict(values, device_count=8)


def test_expert_parallel_option_sets_the_mesh_and_is_checked():
    """--expert_parallel: 1 by default (no expert axis, the mesh as before); a size among the devices (fsdp -1 takes
    the rest); checked against the devices, the options and the policy's expert count (ConfigError naming it: the
    CLI's exit 2)."""
    assert _config().expert_parallel == 1 and _config().mesh_shape == (1, 8, 1)
    cfg = _config(expert_parallel=4)
    assert cfg.mesh_shape == (1, 2, 1) and cfg.data_shards == 2  # the expert axis carries no batch rows
    with pytest.raises(ConfigError, match="does not divide the 8 devices.*tensor_parallel / expert_parallel"):
        _config(expert_parallel=3)
    with pytest.raises(ConfigError, match="expert_parallel must be a positive"):
        _config(expert_parallel=0)
    with pytest.raises(ConfigError, match="rollout_mesh .* with expert_parallel 4"):
        _config(expert_parallel=4, rollout_mesh=(8, 1, 1))
    moe_cfg = config_from_hf(MOE_DICT)  # 4 experts
    check_expert_parallel(1, moe_cfg.replace(num_experts=0))
    check_expert_parallel(4, moe_cfg)
    check_expert_parallel(2, moe_cfg)
    with pytest.raises(ConfigError, match=r"expert_parallel 8 does not divide the policy's 4 experts \(num_experts\)"):
        check_expert_parallel(8, moe_cfg)
    with pytest.raises(ConfigError, match="expert_parallel 2: the policy has no experts"):
        check_expert_parallel(2, moe_cfg.replace(num_experts=0))


# ------------------------------------------------------------------------------------------- 8 devices
def test_mesh_has_an_expert_axis_and_experts_are_split(compare):
    assert compare["mesh"] == {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
    gate = compare["experts_gate"]  # [L 2, E 8, D 32, F 16]: 2 experts per device, embed halved by fsdp
    assert gate == {"shape": [2, 8, 32, 16], "shard": [2, 2, 16, 16], "spec": "P(None, ('expert', 'tensor'), 'fsdp')"}
    assert compare["shard_map_in_update"]  # the experts ran per shard, their sums added over the expert axis


def test_loss_and_grads_expert_parallel_equal_single_device(compare):
    l1, l8 = compare["loss"]
    assert abs(l1) > 1e-3 and abs(l1 - l8) <= 1e-5
    assert compare["grad_norm"] > 1e-3  # a gradient that is not ~0, so the comparison means something
    # measured 1.3e-6 at gradients up to 0.91 (loss 8e-8); the same devices as fsdp 8 without expert parallelism:
    # 1.7e-6 (float32 sums in another order, both)
    assert compare["grad_max_diff"] <= 1e-5 and compare["fsdp_grad_max_diff"] <= 1e-5


def test_update_expert_parallel_equals_single_device(compare):
    """Sampling (a temperature, recorded routes), the old-log-prob pass replaying them and one SGD update: the same
    completions, routes, log-probs, metrics and parameters on the expert-parallel mesh as on one device, and the
    update compiled once (ahead of time, by compile_update)."""
    single, sharded = compare["single"], compare["sharded"]
    assert single["completions"] == sharded["completions"] and single["routes"] == sharded["routes"]
    assert len({tuple(row) for row in single["completions"]}) == 8  # 8 different samples
    mask = np.asarray(single["mask"]) > 0
    for name in ("old_logps", "sampler_logps"):
        np.testing.assert_allclose(np.asarray(sharded[name])[mask], np.asarray(single[name])[mask], atol=1e-5)
    assert single["update_compiles"] == sharded["update_compiles"] == 0
    assert set(single["metrics"]) == set(sharded["metrics"])
    for name, value in single["metrics"].items():
        assert sharded["metrics"][name] == pytest.approx(value, abs=1e-5), name
    assert abs(single["metrics"]["kl"]) > 1e-4 and single["metrics"]["grad_norm"] > 1e-3
    assert compare["param_max_diff"] <= 1e-5


def test_greedy_on_the_expert_parallel_mesh_equals_one_device(compare):
    one, ep = compare["greedy"]
    assert ep == one and len({tuple(row) for row in one}) == 4  # 4 prompts, G = 2 identical greedy rows each
    assert compare["greedy_logps_max_diff"] <= 1e-5


# ------------------------------------------------------------------------------------------- compile-only, a TPU slice
TINY_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=160, hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def test_compile_only_with_expert_parallelism(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """The run's programs compile for a v5e-4 with --expert_parallel 2 (the TPU compiler takes the experts'
    shard_map, megablox): the report's meshes carry the expert axis (the sampler on the training mesh, fsdp 2 x
    expert 2), each chip holds 4 of the 8 experts, split over fsdp on D; a decode step's 8 rows (2 prompts x G 4:
    4 a batch-parallel device; 16 pairs) move to them (`efficiency.rows_move`), so the decode floor counts a quarter
    of the experts, and half of every other matrix (they stay split over fsdp: `efficiency.weights_stay`; the LM
    head's 8 x 4 < 64 x 2). By hand: D 64, 2 routed blocks of attention 64 x 64 + 2 x 64 x 32 + 64 x 64 = 12,288,
    router 64 x 8 = 512 and 8 experts of 3 x 64 x 32 = 6,144 (8 rows x 2 reach all 8), the LM head 64 x 160 =
    10,240, in bf16; the KV caches 2 x 2 layers x (2 prompts x 16 + 8 rows x 32) x 32 x 2 bytes over 4 chips. An
    expert count the option does not divide stops before anything compiles (exit 2, naming it)."""
    model = config_only_model(tmp_path, TINY_QWEN3_MOE, tiny_checkpoint("tokenizer"))
    code, out, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-4", "--expert_parallel", "2"])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    settings = report["settings"]
    assert settings["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}
    assert settings["rollout_mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    assert report["fits"] and set(report["programs"]) >= {"rollout", "update"}
    experts = 2 * 8 * 6144
    weights = 2 * ((2 * (12288 + 512) + 10240) / 2 + experts / 4)
    assert report["programs"]["rollout"]["decode_floor_bytes_per_step"] == weights + 2 * 2 * (32 + 256) * 32 * 2 / 4
    bad = tmp_path / "bad"
    bad.mkdir()
    model = config_only_model(bad, dict(TINY_QWEN3_MOE, num_experts=6), tiny_checkpoint("tokenizer"))
    code, _, err = run_main(capsys, common(bad, model) + ["--topology", "v5e-4", "--expert_parallel", "4"])
    assert code == 2 and "expert_parallel 4 does not divide the policy's 6 experts (num_experts)" in err


# ------------------------------------------------------------------------------------------- the CLI, 8 devices
@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, tiny_checkpoint) -> dict:  # noqa: F811
    """`python -m rloo_jax.train` on the tiny Qwen3-MoE for 2 steps: on one device, and on 8 forced CPU devices with
    --expert_parallel 4 (fsdp 2: the same global batch of 4 prompts x G 4 from 2 completions per device); together."""
    import shutil

    tmp = tmp_path_factory.mktemp("ep_cli")
    model = build_qwen3_moe(tmp / "moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    for f in tiny_checkpoint("tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    data = tmp / "prompts.jsonl"
    # a byte-level tokenizer's random completions: half the printable characters (every other one) score
    letters = ["".join(chr(c) for c in range(32, 127) if (c + i) % 2 == 0) for i in range(2)]
    data.write_text("".join(json.dumps({"prompt": f"spell {i} with", "letters": letters[i % 2]}) + "\n"
                            for i in range(16)))
    common = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--reward_funcs",
              "rloo_jax.demo:letters_reward", "--num_generations", "4", "--max_prompt_length", "16",
              "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1", "--save_steps", "100",
              "--compilation_cache", "false", "--beta", "0.04", "--learning_rate", "0.01",
              "--adam_epsilon", "1e-3"]  # an Adam close to SGD (lr / eps): float noise in ~0 gradients stays noise
    runs = {"single": (["--per_device_train_batch_size", "16"], 1),
            "expert": (["--per_device_train_batch_size", "8", "--expert_parallel", "4"], 8)}
    procs = {}
    for name, (args, devices) in runs.items():
        env = dict(os.environ, XLA_FLAGS=forced_devices(devices), JAX_PLATFORMS="cpu",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs[name] = subprocess.Popen([sys.executable, "-m", "rloo_jax.train", *common, *args, "--output_dir",
                                        str(tmp / name)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {"start": model}
    try:
        for name, p in procs.items():
            _, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"{name}: {stderr[-5000:]}"
            out[name] = tmp / name
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def test_cli_training_with_expert_parallelism_equals_one_device(cli_runs):
    """Two steps through the CLI: the same metrics (the routing mismatch and the sampler/trainer gap among them) and
    the same exported weights on the expert-parallel mesh as on one device (measured: weights moved 1.5e-2, differ by
    1.3e-7; with AdamW's eps 1e-8 instead Adam's normalisation turned float noise in ~0 gradients into steps of a
    few % of the learning rate: 5.6e-4 at lr 0.01)."""
    from safetensors.numpy import load_file

    from rloo_jax.metrics import read_jsonl

    runs = {name: cli_runs[name] for name in ("single", "expert")}
    rows = {name: [r for r in read_jsonl(path / "metrics.jsonl") if "reward" in r] for name, path in runs.items()}
    assert [r["step"] for r in rows["single"]] == [r["step"] for r in rows["expert"]] == [1, 2]
    assert rows["single"][0]["reward_std"] > 0 and rows["single"][1]["grad_norm"] > 1e-4  # rewards that teach
    for one, ep in zip(rows["single"], rows["expert"], strict=True):
        assert "sampling/routing_mismatch" in one and "aux_loss" in one
        for name, value in one.items():
            if name.startswith("timing/") or name == "step_time":
                continue
            assert ep[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
    a, b = (load_file(str(path / "final" / "model.safetensors")) for path in runs.values())
    start = load_file(str(cli_runs["start"] / "model.safetensors"))
    assert a.keys() == b.keys() == start.keys()
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    moved = max(float(np.abs(a[k] - start[k]).max()) for k in a)
    print(f"final weights: moved {moved:.2e} from the start; one device vs expert-parallel: max abs diff {diff:.2e}")
    assert moved > 1e-3 and diff <= 1e-5


def test_a_shard_of_biased_experts_is_its_share():
    """GPT-OSS's experts (biases, the clamped SwiGLU) split over shards as Qwen3-MoE's: the shards' sums are the
    whole sum, and a shard adds nothing (no bias) for the pairs of the experts it does not hold."""
    rs, (t, d, e, f, k), x, experts, w, (gate, up, down) = _pairs(1)
    biases = tuple(jnp.asarray(rs.randn(*s), jnp.float32) for s in ((e, f), (e, f), (e, d)))
    swiglu = (1.702, 1.0)
    whole = moe.experts_apply(x, experts, w, gate, up, down, biases=biases, swiglu=swiglu)
    halves = [moe.experts_apply(x, experts, w, gate[i:i + 2], up[i:i + 2], down[i:i + 2],
                                biases=tuple(b[i:i + 2] for b in biases), swiglu=swiglu, first=i) for i in (0, 2)]
    np.testing.assert_allclose(halves[0] + halves[1], whole, atol=1e-6)
    assert np.abs(np.asarray(whole - moe.experts_apply(x, experts, w, gate, up, down, swiglu=swiglu))).max() > 0.1

    def one(tk: int) -> np.ndarray:  # one pair by hand
        ex, row = int(experts.reshape(-1)[tk]), x[tk // k]
        h = moe.clamped_swiglu(row @ gate[ex] + biases[0][ex], row @ up[ex] + biases[1][ex], *swiglu)
        return np.asarray(w.reshape(-1)[tk] * (h @ down[ex] + biases[2][ex]))

    np.testing.assert_allclose(halves[1][0], one(1), atol=1e-6)  # token 0: expert 3 only on shard 1
    np.testing.assert_allclose(halves[0][1], one(2), atol=1e-6)  # token 1: expert 1 only on shard 0
