"""Sharded step and sampler on device meshes: sharded == single device, FSDP really splits, multi-process == one.

Rule-table goldens run in this process on an ``AbstractMesh`` (no devices needed). Everything that needs 8
devices runs in a subprocess (``XLA_FLAGS`` must be set before jax is imported, and other test modules import jax
first): one 8-device process comparing single-device vs 2x2x2-mesh results, and two processes on localhost
(4 CPU devices each, ``jax.distributed``) running the same scenario with each process loading half the prompts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from rloo_jax import mesh as rmesh
from rloo_jax.models import init_causal_lm
from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 400

TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
)

# The worker: `python -c WORKER compare` (one process, 8 devices) or `python -c WORKER process PORT ID` (one of two
# processes, 4 devices each). Prints one JSON line.
WORKER = r'''
import json, os, re, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
mode = sys.argv[1]
if mode == "process":
    from rloo_jax.mesh import initialize_distributed
    initialize_distributed(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[3]))
import rloo_jax as rj
from rloo_jax import mesh as M
from rloo_jax.models import init_causal_lm
from rloo_jax.sampling import SamplingConfig
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.step import StepConfig, completion_logps
from tests.diffs import tree_max_abs_diff  # NaN-proof (cwd: the repository root)

TINY = json.loads(os.environ["TINY_JSON"])
G, C, B, P = 2, 6, 4, 5
CFG = StepConfig(sampling=SamplingConfig(max_new_tokens=C, num_generations=G, temperature=0.9,
                                         eos_token_ids=(3,), pad_token_id=0), algorithm=rj.RLOO(beta=0.1),
                 steps_per_generation=2, gradient_accumulation_steps=2)  # micro-batches of 4 rows, accumulated
IDS = (np.arange(B * P).reshape(B, P) * 7 % 36 + 4).astype(np.int32)
MASK = np.ones((B, P), np.int32)
MASK[0, :2] = 0
MASK[2, :1] = 0

def copy(t):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), t)

def rewards_of(ids, first_row=0):
    """Host-side 'Python reward function' on rows first_row.. of the completions: [n, 1]; global row 1 is None."""
    r = (ids % 2 == 0).mean(1).astype(np.float32)[:, None]
    r[np.arange(len(ids)) + first_row == 1] = np.nan
    return r

def lora_parts():
    """Adapters (B random, so the KL and A's gradients are not 0) on all projections of the stacked model, with
    dropout; the base is frozen and is the reference."""
    from rloo_jax.models.lora import split_adapters, with_adapters
    from rloo_jax.models import lora_spec
    base = init_causal_lm(TINY, seed=0)
    graphdef, adapters, frozen = split_adapters(with_adapters(base, lora_spec("llama", 4, 8, 0.1, "all-linear"),
                                                              jax.random.key(2)))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), adapters)
    return graphdef, adapters, frozen, nnx.graphdef(base)

def scenario(mesh, lora=False):
    """init -> rollout -> host rewards -> one SGD update; each process feeds only its own prompts/rewards."""
    if lora:
        import dataclasses
        graphdef, params, frozen, ref_graphdef = lora_parts()
        # one micro-batch of all 4 prompts: they split over the 4 data shards, so each prompt runs once for its G
        # completions on the mesh as on one device, and draws the same dropout masks (docs/lora.md)
        cfg = dataclasses.replace(CFG, dropout_seed=3, steps_per_generation=1, gradient_accumulation_steps=1)
        step = Programs(graphdef, optax.sgd(0.5), cfg, mesh=mesh, ref_graphdef=ref_graphdef)
        state = step.init_state(params, frozen=frozen)
    else:
        graphdef, params = nnx.split(init_causal_lm(TINY, seed=0))
        step = Programs(graphdef, optax.sgd(0.5), CFG, mesh=mesh)
        ref = jax.tree.map(lambda x: x + 0.01, copy(params))  # reference != policy, so the KL is not 0
        state = step.init_state(copy(params), ref)
    key, w = jax.random.key(7), np.ones((1,), np.float32)
    if mesh is None:
        ids, mask = IDS, MASK
    else:
        rows = M.process_slice(B)
        ids, mask = M.host_local_batch_to_global(IDS[rows], mesh), M.host_local_batch_to_global(MASK[rows], mesh)
        key, w = M.replicate(key, mesh), M.replicate(w, mesh)
    rollout_args = (state, ids, mask, key)
    ro = step.rollout(*rollout_args)
    local = M.local_rows(ro.completion_ids)
    r = rewards_of(local, first_row=0 if mesh is None else M.process_slice(B * G).start)
    rewards = r if mesh is None else M.host_local_batch_to_global(r, mesh)
    step.compile_update(ids.shape, 1)  # ahead of time, as the trainer does on its first step
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    state, metrics = step.update(state, ro, rewards, w)
    jax.block_until_ready(state)
    jax.monitoring.unregister_event_duration_listener(listener)
    metrics = flat_metrics(metrics)  # eager reductions compile their own small programs: not the update's
    sums = jax.jit(lambda t: [jnp.sum(x) for x in jax.tree.leaves(t)])
    return {
        "completions": local.tolist(),
        "old_logps": M.local_rows(ro.old_logps).tolist(),
        "completions_spec": str(getattr(ro.completion_ids.sharding, "spec", None)),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "param_sums": [float(s) for s in sums(state.params)],
        "step": int(state.step),
        "update_compiles": len(compiles),
    }, state, step, rollout_args

out = {}
if mode == "process":
    res, *_ = scenario(M.make_mesh(2, -1, 2))
    out = {"process_index": jax.process_index(), "devices": jax.device_count(),
           "local_devices": jax.local_device_count(), **res}
    out["lora"] = scenario(M.make_mesh(2, -1, 2), lora=True)[0]
    jax.distributed.shutdown()
else:
    mesh = M.make_mesh(2, 2, 2)
    single, s_state, _, _ = scenario(None)
    sharded, m_state, m_step, rollout_args = scenario(mesh)
    # per-device KV-cache buffers of the compiled sharded rollout (test-only peek at the jitted function):
    # [L, N, K, C, Dh] = [2, 8, 2, 6, 8] split over data x fsdp (rows) and tensor (K)
    hlo = m_step.rollout_program(*rollout_args[1].shape).lower().compile().as_text()
    out["cache_shapes"] = sorted(set(re.findall(r"f32\[2,\d+,\d+,6,8\]", hlo)))
    out["single"], out["sharded"] = single, sharded
    # the sampler on meshes of its own over the same devices: data-parallel with whole weights (the "gathered"
    # sampler), tensor-parallel x data-parallel (heads, MLP, vocabulary and KV heads over 2), tensor-parallel over
    # all 8 (the 4 heads and 2 KV heads do not split 8 ways: replicated, the MLP and vocabulary split)
    out["layouts"] = {}
    for shape in [(8, 1, 1), (4, 1, 2), (1, 1, 8)]:
        r_step = Programs(m_step.graphdef, optax.sgd(0.5), CFG, mesh=mesh, rollout_mesh=M.reshaped(mesh, shape))
        params = nnx.split(init_causal_lm(TINY, seed=0))[1]
        r_state = r_step.init_state(copy(params), jax.tree.map(lambda x: x + 0.01, copy(params)))
        ro = r_step.sample(r_state, *rollout_args[1:])  # the sampling program alone (the reference pass: training's)
        rows = {name: M.local_rows(getattr(ro, name)).tolist() for name in ("completion_ids", "old_logps")}
        out["layouts"][str(shape)] = dict(rows, spec=str(ro.completion_ids.sharding.spec),
                                          devices=[d.id for d in r_step.rollout_mesh.devices.flat])
    out["mesh_devices"] = [d.id for d in mesh.devices.flat]
    # greedy decoding on the tensor-parallel sampler == on one device (== transformers, tests/test_sampling.py)
    import dataclasses
    from rloo_jax.sampling import generate_fn
    greedy = dataclasses.replace(CFG.sampling, temperature=0.0)
    params = nnx.split(init_causal_lm(TINY, seed=0))[1]
    one = jax.jit(generate_fn, static_argnums=(0, 5))(m_step.graphdef, params, IDS, MASK, jax.random.key(0), greedy)
    tp = M.reshaped(mesh, (1, 1, 8))
    on_tp = jax.jit(generate_fn, static_argnums=(0, 5, 6))(
        m_step.graphdef, M.shard_params(params, M.param_shardings(params, mesh)), *rollout_args[1:3],
        jax.random.key(0), greedy, tp)
    out["greedy"] = [np.asarray(one.completion_ids).tolist(), M.local_rows(on_tp.completion_ids).tolist()]
    out["lora_single"], _, _, _ = scenario(None, lora=True)
    out["lora_sharded"], l_state, l_step, _ = scenario(mesh, lora=True)
    # LoRA (adapters and the frozen base) sampled tensor-parallel x data-parallel
    tp_step = Programs(l_step.graphdef, optax.sgd(0.5), l_step.cfg, mesh=mesh, ref_graphdef=l_step.ref_graphdef,
                       rollout_mesh=M.reshaped(mesh, (4, 1, 2)))
    _, l_params, l_frozen, _ = lora_parts()
    ro = tp_step.sample(tp_step.init_state(l_params, frozen=l_frozen), *rollout_args[1:])
    out["lora_tp"] = {"completions": M.local_rows(ro.completion_ids).tolist(),
                      "old_logps": M.local_rows(ro.old_logps).tolist()}
    a = l_state.params["model"]["layers"]["attn"]["q"]["lora_a"][...]  # [L 2, embed 32, r 4]
    out["lora_a"] = {"shard": list(a.addressable_shards[0].data.shape), "spec": str(a.sharding.spec)}
    out["lora_frozen_head_shard"] = list(l_state.frozen["lm_head"]["kernel"][...].addressable_shards[0].data.shape)
    out["param_max_diff"] = tree_max_abs_diff(s_state.params, m_state.params, "params, one device vs the mesh")
    # the loss and its gradients, jitted with sharded params/batch vs on one device
    graphdef, params = nnx.split(init_causal_lm(TINY, seed=0))
    sp = M.shard_params(params, M.param_shardings(params, mesh))
    one_device = Programs(graphdef, optax.sgd(0.0), CFG)
    ro = one_device.rollout(one_device.init_state(params, params), IDS, MASK, jax.random.key(1))
    rewards = rewards_of(np.asarray(ro.completion_ids))
    def loss_fn(p, ro, rewards):
        lp = completion_logps(graphdef, p, jnp.repeat(ro.prompt_ids, G, 0), jnp.repeat(ro.prompt_mask, G, 0),
                              ro.completion_ids, ro.completion_mask, 0.9)
        # off-policy (old != current: ratio in (1, 1 + eps), varying by row) so the loss itself is not ~0
        old = jax.lax.stop_gradient(lp) * 1.03
        ref = jax.lax.stop_gradient(lp) + 0.01 * ro.completion_mask
        return rj.rloo_loss(lp, old, ref, rewards, ro.completion_mask, ro.is_truncated, num_generations=G,
                            reward_weights=jnp.ones(1), options=CFG.algorithm)[0]
    vg = jax.jit(jax.value_and_grad(loss_fn))
    l1, gr1 = vg(params, ro, rewards)
    put = lambda x: jax.device_put(x, M.batch_sharding(mesh, x.shape))
    l8, gr8 = vg(sp, jax.tree.map(put, ro), put(rewards))
    out["loss"] = [float(l1), float(l8)]
    out["grad_max_diff"] = tree_max_abs_diff(gr1, gr8, "gradients, one device vs the mesh")
    out["grad_norm"] = float(optax.global_norm(gr1))
    # FSDP x tensor: the state is really split across devices
    w = m_state.params["lm_head"]["kernel"][...]
    out["lm_head"] = {"shape": list(w.shape), "shard": list(w.addressable_shards[0].data.shape),
                      "devices": len(w.sharding.device_set), "spec": str(w.sharding.spec)}
    emb = m_state.ref_params["model"]["embed"]["embedding"][...]
    out["ref_embed_shard"] = list(emb.addressable_shards[0].data.shape)
    out["step_spec"] = str(m_state.step.sharding.spec)
    # make_mesh with -1, and its errors
    out["mesh_shapes"] = [list(M.make_mesh(*a).devices.shape) for a in [(1, -1, 1), (2, -1, 2), (-1, 2, 1)]]
    errors = []
    for args in [(3, -1, 1), (2, 2, 1), (-1, -1, 2), (0, -1, 1)]:
        try:
            M.make_mesh(*args)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out["mesh_errors"] = errors
print("RESULT " + json.dumps(out))
'''


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=forced_devices(devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        TINY_JSON=json.dumps(TINY),
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers() -> dict:
    """Start the 8-device comparison and the two 4-device processes together (they are independent), collect
    their JSON; every child is killed on failure or timeout."""
    port = str(_free_port())
    commands = {
        "compare": (["compare"], 8),
        "process0": (["process", port, "0"], 4),
        "process1": (["process", port, "1"], 4),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", WORKER, *args], cwd=ROOT, env=_env(devices),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, (args, devices) in commands.items()
    }
    results = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"{name}: {stderr[-5000:]}"
            results[name] = _result(stdout)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


@pytest.fixture(scope="module")
def compare(workers: dict) -> dict:
    return workers["compare"]


@pytest.fixture(scope="module")
def two_processes(workers: dict) -> list[dict]:
    return [workers["process0"], workers["process1"]]


# ------------------------------------------------------------------------------------------- rule table goldens
MESH = AbstractMesh((2, 2, 2), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def test_rule_table_goldens():
    assert rmesh.logical_to_spec(("embed", "mlp"), MESH) == PartitionSpec("fsdp", "tensor")
    assert rmesh.logical_to_spec(("mlp", "embed"), MESH) == PartitionSpec("tensor", "fsdp")
    assert rmesh.logical_to_spec(("vocab", "embed"), MESH) == PartitionSpec("tensor", "fsdp")
    assert rmesh.logical_to_spec(("embed", "heads"), MESH) == PartitionSpec("fsdp", "tensor")
    assert rmesh.logical_to_spec(("embed", "kv"), MESH) == PartitionSpec("fsdp", "tensor")
    assert rmesh.logical_to_spec(("batch", None), MESH) == PartitionSpec(("data", "fsdp"))
    assert rmesh.logical_to_spec((None, "unknown"), MESH) == PartitionSpec()


def test_fit_spec_drops_axes_that_do_not_divide():
    # embed 32 over fsdp 2 kept; mlp 3 not divisible by tensor 2 -> replicated
    assert rmesh.fit_spec(("embed", "mlp"), (32, 3), MESH) == PartitionSpec("fsdp")
    # batch over data x fsdp = 4: 6 rows -> only data (2) divides; 1 row -> nothing
    assert rmesh.fit_spec(("batch",), (6,), MESH) == PartitionSpec("data")
    assert rmesh.fit_spec(("batch",), (8,), MESH) == PartitionSpec(("data", "fsdp"))
    assert rmesh.fit_spec(("batch", None), (1, 5), MESH) == PartitionSpec()
    # one mesh axis at most once per array: the second "mlp" is replicated
    assert rmesh.fit_spec(("mlp", "mlp"), (4, 4), MESH) == PartitionSpec("tensor")
    custom = {"embed": ("fsdp", "tensor")}
    assert rmesh.fit_spec(("embed",), (8,), MESH, custom) == PartitionSpec(("fsdp", "tensor"))
    assert rmesh.fit_spec(("embed",), (6,), MESH, custom) == PartitionSpec("fsdp")
    with pytest.raises(ValueError, match="do not match"):
        rmesh.fit_spec(("embed",), (4, 4), MESH)


def test_a_decode_steps_rows_move_to_the_lm_head_while_their_partial_logits_are_smaller():
    """The LM head [D, V] ("embed", "vocab") by `stationary_side`: gpt-oss-20b's D 2,880 x V 201,088 in bf16 on
    fsdp 8 stays split along D (side 0) while rows x (2,880 x 2 / 8 + 201,088 x 4) < 2,880 x 201,088 x 2 bytes,
    i.e. up to 1,438 rows (1,432 of them, which fsdp splits: yes; 1,440: gathered); never without fsdp."""
    fsdp8 = AbstractMesh((1, 8, 1), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    tensor8 = AbstractMesh((1, 1, 8), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    head, axes = (2880, 201088), ("embed", "vocab")
    assert rmesh.stationary_side(256, head, axes, 2) is None  # no mesh
    with jax.sharding.use_abstract_mesh(fsdp8):
        assert rmesh.stationary_side(256, head, axes, 2) == 0 and rmesh.stationary_side(1432, head, axes, 2) == 0
        assert rmesh.stationary_side(1440, head, axes, 2) is None
    with jax.sharding.use_abstract_mesh(tensor8):
        assert rmesh.stationary_side(256, head, axes, 2) is None


def test_a_decode_steps_rows_pick_the_side_the_weight_stays_split_on():
    """`stationary_side` on fsdp 4, by `efficiency.weights_stay`'s bytes: 16 rows against Llama-3.1-8B's q [4096,
    4096] stay on din (16 x (2,048 + 16,384) < 33.5M), o on dout, a k [64, 32] of 64 rows is gathered (64 x (32 +
    128) = 10,240 > 4,096); rows fsdp does not split, a weight not split over fsdp (tensor alone), or no fsdp:
    gathered (None)."""
    mesh = lambda *shape: AbstractMesh(shape, rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)  # noqa: E731
    q, o = ((4096, 4096), ("embed", "heads")), ((4096, 4096), ("heads", "embed"))
    assert rmesh.stationary_side(16, *q, 2) is None  # no mesh
    with jax.sharding.use_abstract_mesh(mesh(1, 4, 1)):
        assert rmesh.stationary_side(16, *q, 2) == 0 and rmesh.stationary_side(16, *o, 2) == 1
        assert rmesh.stationary_side(64, (64, 32), ("embed", "kv"), 2) is None
        assert rmesh.stationary_side(62, *q, 2) is None  # 4 does not divide 62 rows
        assert rmesh.stationary_side(16, (4096, 4096), (None, "mlp"), 2) is None
    with jax.sharding.use_abstract_mesh(mesh(1, 1, 4)):
        assert rmesh.stationary_side(16, *q, 2) is None


STATIONARY_WORKER = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from rloo_jax import mesh as M
from rloo_jax.models import init_causal_lm, transformer
from tests.xla_flags import largest_all_gather

model = init_causal_lm(CONFIG, seed=0)
ids = jnp.asarray(np.random.RandomState(0).randint(0, 40, (8, 1)), jnp.int32)  # a decode step's 8 rows
mask = jnp.ones((8, 1), jnp.int32)
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
logits = lambda p: nnx.merge(graphdef, p, rest)(ids, mask)  # noqa: E731
grad = lambda p: jax.grad(lambda p: (logits(p) ** 2).mean())(p)  # noqa: E731
ref, ref_g = np.asarray(jax.jit(logits)(params)), jax.jit(grad)(params)
sides, real = set(), transformer.stationary_matmul
def spy(x, w, axes, side, transposed=False):
    sides.add((axes, side, transposed))
    return real(x, w, axes, side, transposed)
transformer.stationary_matmul = spy
mesh = M.make_mesh(1, 4, 1, devices=jax.devices())
with jax.set_mesh(mesh):
    placed = M.shard_params(params, M.param_shardings(params, mesh))
    out, g = np.asarray(jax.jit(logits)(placed)), jax.jit(grad)(placed)
    moved = largest_all_gather(jax.jit(logits).lower(placed).compile().as_text())
    # the sampler's weights (`rollout_weights`): the LM head V-split over fsdp, the rows going to it (side 1)
    from rloo_jax.sampling import rollout_weights
    seen, sides = sides, set()
    sampled = jax.jit(lambda p: nnx.merge(graphdef, rollout_weights(graphdef, p), rest)(ids, mask))
    s_out = np.asarray(sampled(placed))
    s_moved = largest_all_gather(sampled.lower(placed).compile().as_text())
    s_sides, sides = sorted([list(a), s, t] for a, s, t in sides), seen
    M.weights_stay = lambda *args: False  # the negative control: every matrix gathered
    gathered = largest_all_gather(jax.jit(lambda p: logits(p)).lower(placed).compile().as_text())  # retraced
gdiff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)))
print("RESULT " + json.dumps({"diff": float(np.abs(out - ref).max()), "scale": float(np.abs(ref).max()),
                              "grad": gdiff, "moved": moved, "gathered": gathered,
                              "sides": sorted([list(a), s, t] for a, s, t in sides),
                              "sampler": {"diff": float(np.abs(s_out - ref).max()), "moved": s_moved,
                                          "sides": s_sides}}))
'''


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_steps_rows_move_to_the_matrices_on_fsdp(tied):
    """A decode step's 8 rows on fsdp 4 (4 host devices; D 128, float32): every block matrix and the LM head stay
    split where they lie (`transformer.stationary_matmul`: q, k, v, gate, up and the head on din, o and down on
    dout; a tied embedding [V, D] as it is stored), no all-gather as large as the smallest of them (k: 128 x 64;
    the negative control gathers gate's 128 x 256), and the logits and the gradients are one device's up to the
    partial sums' order."""
    from tests.xla_flags import result_on_devices

    config = dict(TINY, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=tied)
    result = result_on_devices(STATIONARY_WORKER.replace("CONFIG", repr(config)), 4)
    blocks = [[["embed", "heads"], 0, False], [["embed", "kv"], 0, False], [["embed", "mlp"], 0, False],
              [["heads", "embed"], 1, False], [["mlp", "embed"], 1, False]]
    assert result["sides"] == sorted([*blocks, [["embed", "vocab"], 0, tied]]), result
    # the sampler's head (`sampling.rollout_weights`): V-split, the rows go to it and come back as logits
    sampler = result["sampler"]
    print(sampler)
    assert sampler["sides"] == sorted([*blocks, [["decode_embed", "decode_vocab"], 1, tied]]), result
    assert 0 <= sampler["moved"] < 128 * 64 and sampler["diff"] <= 2e-6 * result["scale"], result
    assert 0 <= result["moved"] < 128 * 64 <= 128 * 256 <= result["gathered"], result
    assert result["diff"] <= 2e-6 * result["scale"], result  # measured 6.9e-7 relative; NaN fails
    assert result["grad"] <= 4e-6, result  # each gradient's largest difference over its largest: measured 1.8e-6


def test_param_shardings_of_tiny_model():
    cfg = dict(TINY, num_attention_heads=3, num_key_value_heads=1, hidden_size=24, intermediate_size=36)
    model = init_causal_lm(cfg, seed=0)  # q: 24 (3 heads x 8), k: 8, mlp 36, vocab 40
    mesh = AbstractMesh((1, 2, 8), rmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    specs = jax.tree.map(lambda s: s.spec, rmesh.param_shardings(model, mesh))
    layer = specs["model"]["layers"]  # stacked blocks: the leading layer axis is never split
    assert layer["mlp"]["gate"]["kernel"] == PartitionSpec(None, "fsdp")  # 36 % 8 != 0 -> mlp replicated
    assert layer["attn"]["q"]["kernel"] == PartitionSpec(None, "fsdp", "tensor")  # 24 % 8 == 0
    assert layer["attn"]["k"]["kernel"] == PartitionSpec(None, "fsdp", "tensor")  # 8 % 8 == 0
    assert layer["attn"]["o"]["kernel"] == PartitionSpec(None, "tensor", "fsdp")
    assert layer["attn_norm"]["scale"] == PartitionSpec(None, "fsdp")
    assert specs["lm_head"]["kernel"] == PartitionSpec("fsdp", "tensor")  # 40 % 8 == 0
    assert specs["model"]["final_norm"]["scale"] == PartitionSpec("fsdp")


def test_state_shardings_mirror_params_in_optimizer_state():
    """Adam's mu/nu take the params' shardings; counts, step and a factored statistic are replicated."""
    from flax import nnx

    from rloo_jax.step import TrainState

    _, params = nnx.split(init_causal_lm(TINY, seed=0))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    abstract = jax.eval_shape(lambda p: TrainState(p, opt.init(p), p, jnp.zeros((), jnp.int32)), params)
    shard = rmesh.state_shardings(abstract, MESH)
    adam = shard.opt_state[1][0]
    for tree in (shard.params, shard.ref_params, adam.mu, adam.nu):
        assert tree["lm_head"]["kernel"].spec == PartitionSpec("fsdp", "tensor")
        assert tree["model"]["layers"]["mlp"]["down"]["kernel"].spec == PartitionSpec(None, "tensor", "fsdp")
    assert adam.count.spec == PartitionSpec() and shard.step.spec == PartitionSpec()
    # a same-structure subtree whose leaves have other shapes (factored second moments) is replicated
    fake = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,), x.dtype), params)
    odd = rmesh.state_shardings(abstract.replace(opt_state=(fake,)), MESH)
    assert all(s.spec == PartitionSpec() for s in jax.tree.leaves(odd.opt_state))


def test_mesh_shape_resolution_and_errors():
    resolve = rmesh._resolve_mesh_shape
    assert resolve({"data_parallel": 1, "fsdp": -1, "tensor_parallel": 1}, 8) == (1, 8, 1)
    assert resolve({"data_parallel": 2, "fsdp": -1, "tensor_parallel": 2}, 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="needs 4 devices but 8"):
        resolve({"data_parallel": 2, "fsdp": 2, "tensor_parallel": 1}, 8)
    with pytest.raises(ValueError, match="at most one"):
        resolve({"data_parallel": -1, "fsdp": -1, "tensor_parallel": 1}, 8)
    assert rmesh.make_mesh(1, -1, 1).devices.shape == (1, len(jax.devices()), 1)


def test_rollout_shape_rule_goldens():
    """The sampler's own layout (`rollout_mesh` None): whole weights on every device where a copy fits 1/4 of one,
    else tensor-parallel as far as the heads allow where that share fits; else the training mesh."""
    gb = 1e9

    def rule(train, weights, device=16.9 * gb, heads=32, kv_heads=8):
        return rmesh.rollout_shape(train, weights * gb, device, heads, kv_heads)

    assert rule((1, 8, 1), 3) == (8, 1, 1)  # 3 GB <= 4.225: whole weights, data-parallel over all 8
    assert rule((1, 8, 1), 16) == (1, 1, 8)  # 16 GB does not fit whole: tensor-parallel over 8, 2 GB each
    assert rule((1, 8, 1), 64) == (1, 8, 1)  # 8 GB per device even 8-way: the training mesh
    assert rule((1, 8, 1), 16, device=None) == (1, 8, 1)  # no memory figure (CPU)
    assert rule((8, 1, 1), 16) == (8, 1, 1) and rule((1, 1, 8), 16) == (1, 1, 8)  # no fsdp: nothing to gather
    assert rule((1, 8, 1), 16, kv_heads=2) == (1, 8, 1)  # t must divide the KV heads: 2-way holds 8 GB
    assert rule((1, 8, 1), 8, kv_heads=2) == (4, 1, 2)
    assert rule((1, 8, 1), 16, heads=28, kv_heads=4) == (2, 1, 4)  # 28 heads: at most 4-way on 8 devices
    assert rule((1, 4, 2), 3) == (4, 1, 2)  # whole weights per tensor shard of training (never less split)
    assert rule((2, 2, 2), 16) == (1, 1, 8)


def test_process_slice_and_cluster_detection(monkeypatch):
    assert rmesh.process_slice(8, 0, 2) == slice(0, 4)
    assert rmesh.process_slice(8, 1, 2) == slice(4, 8)
    assert rmesh.process_slice(6, 2, 3) == slice(4, 6)
    with pytest.raises(ValueError, match="cannot be split"):
        rmesh.process_slice(5, 0, 2)
    assert rmesh.detect_cluster({}) is None
    assert rmesh.detect_cluster({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "3"}) is None
    assert rmesh.detect_cluster({"SLURM_NTASKS": "4"}) == "slurm"
    assert rmesh.detect_cluster({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert rmesh.detect_cluster({"OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert rmesh.detect_cluster({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert rmesh.detect_cluster({"TPU_WORKER_HOSTNAMES": "h0,h1"}) == "tpu"
    assert rmesh.detect_cluster({"MEGASCALE_NUM_SLICES": "2"}) == "tpu"
    # a single plain host: nothing to initialize, and no partial explicit arguments
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                 "MEGASCALE_NUM_SLICES", "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS",
                 "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert rmesh.initialize_distributed() is False
    assert rmesh.initialize_distributed("127.0.0.1:1", 1, 0) is False
    with pytest.raises(ValueError, match="needs all of"):
        rmesh.initialize_distributed("127.0.0.1:1234")


# ------------------------------------------------------------------------------------------- 8 devices
def test_sampler_sharded_equals_single_device(compare):
    """The rollout's sampler (prefill + KV-cache decode) on the 2x2x2 mesh: same key -> same completions."""
    single, sharded = compare["single"], compare["sharded"]
    assert single["completions"] == sharded["completions"]
    assert len({tuple(row) for row in single["completions"]}) == 8  # 8 different samples, not one repeated
    np.testing.assert_allclose(sharded["old_logps"], single["old_logps"], atol=1e-5)
    assert sharded["completions_spec"] == "P(('data', 'fsdp'),)"  # N = 8 rows split over data x fsdp = 4


@pytest.mark.parametrize("shape", ["(8, 1, 1)", "(4, 1, 2)", "(1, 1, 8)"])
def test_rollout_on_its_own_mesh_samples_the_same(compare, shape):
    """The sampler on a mesh of its own (data-parallel with whole weights, tensor-parallel x data-parallel,
    tensor-parallel over all 8 devices; the weights resharded inside the rollout program): the same tokens and the
    same log-probs as on the (2, 2, 2) training mesh, handed back in the training layout over the same devices."""
    want, got = compare["sharded"], compare["layouts"][shape]
    assert got["completion_ids"] == want["completions"]
    # measured 2.1e-6 with tensor 8; (4, 1, 2) has training's tensor split, but on training's fsdp 2 a decode
    # step's rows move to the matrices (`transformer.stationary_matmul`, `Transformer.unembed`) and each device's
    # partial sums are added in another order
    np.testing.assert_allclose(got["old_logps"], want["old_logps"], atol=1e-5)
    assert got["spec"] == "P(('data', 'fsdp'),)" and got["devices"] == compare["mesh_devices"]


def test_greedy_on_the_tensor_parallel_sampler_equals_one_device(compare):
    """Greedy decoding on an 8-way tensor-parallel sampler mesh picks the tokens one device picks (which are
    transformers' own: tests/test_sampling.py::test_greedy_matches_transformers_with_early_eos)."""
    one, tp = compare["greedy"]
    assert tp == one and len({tuple(row) for row in one}) == 4  # 4 prompts, G = 2 identical greedy rows each


def test_lora_samples_the_same_on_a_tensor_parallel_sampler(compare):
    want, got = compare["lora_sharded"], compare["lora_tp"]
    assert got["completions"] == want["completions"]
    np.testing.assert_allclose(got["old_logps"], want["old_logps"], atol=1e-5)  # measured 1.2e-6


def test_kv_cache_is_sharded_in_the_sampler(compare):
    """The decode cache [L, N, K, C, Dh] lives split: N over data x fsdp, K heads over tensor (never whole)."""
    assert compare["cache_shapes"] == ["f32[2,2,1,6,8]"]


def test_loss_and_grads_sharded_equal_single_device(compare):
    l1, l8 = compare["loss"]
    assert abs(l1) > 1e-3 and abs(l1 - l8) <= 1e-5
    assert compare["grad_norm"] > 1e-3  # a gradient that is not ~0, so the comparison below means something
    assert compare["grad_max_diff"] <= 1e-5


def test_update_sharded_equals_single_device(compare):
    single, sharded = compare["single"], compare["sharded"]
    assert single["step"] == sharded["step"] == 1
    assert single["update_compiles"] == sharded["update_compiles"] == 0  # compile_update's executable was reused
    assert set(single["metrics"]) == set(sharded["metrics"])
    for name, value in single["metrics"].items():
        assert sharded["metrics"][name] == pytest.approx(value, abs=1e-5), name
    assert abs(single["metrics"]["kl"]) > 1e-4 and single["metrics"]["grad_norm"] > 1e-3
    assert compare["param_max_diff"] <= 1e-5
    np.testing.assert_allclose(single["param_sums"], sharded["param_sums"], atol=1e-4)


def test_state_is_really_sharded(compare):
    head = compare["lm_head"]  # [embed 32, vocab 40] over (fsdp 2, tensor 2)
    assert head["shape"] == [32, 40] and head["shard"] == [16, 20]
    assert head["devices"] == 8 and head["spec"] == "P('fsdp', 'tensor')"
    assert compare["ref_embed_shard"] == [20, 16]  # the reference model too
    assert compare["step_spec"] == "P()"


def test_make_mesh_on_8_devices(compare):
    assert compare["mesh_shapes"] == [[1, 8, 1], [2, 2, 2], [4, 2, 1]]
    errors = compare["mesh_errors"]
    assert "does not divide the 8 devices" in errors[0] and "fsdp=-1" in errors[0]
    assert "needs 4 devices but 8" in errors[1]
    assert "at most one" in errors[2]
    assert "positive or -1" in errors[3]


def test_lora_update_sharded_equals_single_device(compare):
    """LoRA on the 2x2x2 mesh (stacked layers, dropout): the same completions, metrics and adapters as on one
    device; the adapters and the frozen base are sharded by the rule table (the rank axis replicated)."""
    single, sharded = compare["lora_single"], compare["lora_sharded"]
    assert single["completions"] == sharded["completions"]
    for name, value in single["metrics"].items():
        assert sharded["metrics"][name] == pytest.approx(value, abs=1e-5), name
    assert abs(single["metrics"]["kl"]) > 1e-4 and single["metrics"]["grad_norm"] > 1e-3
    np.testing.assert_allclose(single["param_sums"], sharded["param_sums"], atol=1e-4)
    assert compare["lora_a"] == {"shard": [2, 16, 4], "spec": "P(None, 'fsdp')"}
    assert compare["lora_frozen_head_shard"] == [16, 20]


# ------------------------------------------------------------------------------------------- 2 processes
def test_two_processes_equal_one_process(two_processes, compare):
    """Each process loads half the prompts and rewards its own completions; results == one 8-device process."""
    p0, p1 = two_processes
    assert (p0["devices"], p0["local_devices"], p1["process_index"]) == (8, 4, 1)
    want = compare["sharded"]
    assert p0["completions"] + p1["completions"] == want["completions"]  # each process holds its own rows
    np.testing.assert_allclose(p0["old_logps"] + p1["old_logps"], want["old_logps"], atol=1e-5)
    for p in (p0, p1):
        assert p["step"] == 1 and p["update_compiles"] == 0
        for name, value in want["metrics"].items():
            assert p["metrics"][name] == pytest.approx(value, abs=1e-5), name
        np.testing.assert_allclose(p["param_sums"], want["param_sums"], atol=1e-5)
        for name, value in compare["lora_sharded"]["metrics"].items():  # LoRA, two processes
            assert p["lora"]["metrics"][name] == pytest.approx(value, abs=1e-5), name
        np.testing.assert_allclose(p["lora"]["param_sums"], compare["lora_sharded"]["param_sums"], atol=1e-5)
