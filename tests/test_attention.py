"""Attention implementations against the einsum reference: splash (Pallas TPU kernels, interpreted on CPU) and the
cuDNN path's call (`jax.nn.dot_product_attention`, run through XLA here), values and gradients, with left padding,
GQA, a sliding window, a score scale and soft-capping (Gemma), the plain and the shared-prompt forms; how each is
chosen and refused; the einsum reference against a plain loop."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax.efficiency import attention_kernel_flops, block_sparse_pairs
from rloo_jax.models import attention
from rloo_jax.models.transformer import positions_from_mask
from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]
H, K, DH = 4, 2, 16  # GQA: two query heads per kv head
# Measured (f32, these shapes, inputs ~ N(0, 1)): splash and the XLA call within 1.5e-6 of the einsum, values and
# gradients (largest entries 2-6); they sum in another order. The tolerance asked of them: 1e-5.
TOL = 1e-5


def _qkv(rng: np.random.RandomState, b: int, t: int, heads: int) -> jax.Array:
    return jnp.asarray(rng.normal(size=(b, t, heads, DH)), jnp.float32)


def _left_mask(t: int, lengths: list[int]) -> np.ndarray:
    mask = np.zeros((len(lengths), t), np.int32)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1
    return mask


def _assert_close(ours, ref, valid) -> None:  # noqa: ANN001
    """Values at the real query rows (padding rows are garbage in every implementation and feed nothing)."""
    v = np.asarray(valid, bool)
    np.testing.assert_allclose(np.asarray(ours)[v], np.asarray(ref)[v], atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------------------------- choosing
def test_resolve_defaults_and_refusals():
    assert attention.resolve(None, "tpu", "bfloat16") == attention.resolve(None, "tpu", "float32") == "splash"
    assert attention.resolve(None, "gpu", "bfloat16") == attention.resolve(None, "cuda", "float16") == "cudnn"
    assert attention.resolve(None, "gpu", "float32") == "eager"  # cuDNN's flash attention takes bf16/fp16 only
    assert attention.resolve(None, "cpu", "bfloat16") == "eager" and attention.resolve("eager", "tpu", "x") == "eager"
    for impl, platform, valid in [("cudnn", "tpu", "eager, splash"), ("splash", "gpu", "eager, cudnn"),
                                  ("splash", "cpu", "eager"), ("cudnn", "cpu", "eager")]:
        with pytest.raises(ValueError, match=f"not available on {platform}; valid there: {valid} "):
            attention.resolve(impl, platform, "bfloat16")
    with pytest.raises(ValueError, match="needs bf16/fp16"):
        attention.resolve("cudnn", "gpu", "float32")
    # XLA's deterministic GPU ops: not chosen (an update program failed executing with it on an H200), refused
    assert attention.resolve(None, "gpu", "bfloat16", deterministic=True) == "eager"
    assert attention.resolve(None, "tpu", "bfloat16", deterministic=True) == "splash"  # TPUs need no flag
    with pytest.raises(ValueError, match="deterministic GPU ops"):
        attention.resolve("cudnn", "gpu", "bfloat16", deterministic=True)


def test_model_options_follow_the_determinism_flag(monkeypatch):
    """`full_determinism` (XLA_FLAGS) on a GPU: the run resolves eager attention, and refuses cudnn in one line."""
    from rloo_jax import numerics
    from rloo_jax.algorithms import RLOOConfig
    from rloo_jax.errors import ConfigError

    cfg = RLOOConfig()
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    assert numerics.model_options(cfg, "gpu")["attn_implementation"] == "cudnn"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere --xla_gpu_deterministic_ops=true")
    assert numerics.determinism_enabled() and numerics.model_options(cfg, "gpu")["attn_implementation"] == "eager"
    with pytest.raises(ConfigError, match="deterministic GPU ops.*fix attn_implementation"):
        numerics.model_options(cfg.replace(attn_implementation="cudnn"), "gpu")


def test_splash_layout_goldens():
    assert attention.splash_layout(8192, 8448) == (512, 384, 8192, 8448)  # the 8k rows: completion + 256 prompt
    assert attention.splash_layout(5, 11) == (128, 256, 128, 256)  # a padded query keeps its own padded key
    assert attention.splash_layout(256, 256) == (256, 256, 256, 256)
    # what the kernel is then charged (tests/test_efficiency.py has the counting rule's goldens)
    bq, bkv, tp, sp = attention.splash_layout(8192, 8448)
    # query block i (shifted rows 512 i + 256 .. 512 i + 767) reaches key block (512 i + 767) // 384: 2 .. 22 blocks
    blocks = sum((512 * i + 767) // 384 + 1 for i in range(16))
    assert blocks == 197 and block_sparse_pairs(tp, sp, bq, bkv, offset=256) == blocks * 512 * 384
    assert attention_kernel_flops(2, 12, 128, 1) == 4 * 2 * 12 * 128


def test_rotations_goldens():
    mask = jnp.array([[0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
    np.testing.assert_array_equal(attention.front_shift(mask), [2, 0, 0, 1])
    x = jnp.arange(8).reshape(2, 4)
    np.testing.assert_array_equal(attention.rotate_rows(x, jnp.array([1, 3])), [[1, 2, 3, 0], [7, 4, 5, 6]])
    np.testing.assert_array_equal(attention.rotate_rows(attention.rotate_rows(x, jnp.array([1, 3])),
                                                        -jnp.array([1, 3])), x)


# ----------------------------------------------------------------------------------------------- the reference
def test_eager_attention_with_scale_and_softcap_equals_a_loop():
    """softmax(cap * tanh(scale q.k / cap), masked) v, per row, query head and key, against `attend` (GQA)."""
    rng = np.random.RandomState(3)
    b, t = 2, 5
    q, k, v = (rng.normal(size=(b, t, n, DH)).astype(np.float32) * 3 for n in (H, K, K))
    allowed = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    allowed[1, :, :2] = False
    allowed[1, :2, :2] = np.eye(2, dtype=bool)  # the padding queries see themselves
    scale, cap = 0.3, 2.0
    ref = np.zeros_like(q)
    for i in range(b):
        for j in range(t):
            for h in range(H):
                s = np.array([cap * np.tanh(scale * q[i, j, h] @ k[i, u, h // (H // K)] / cap) for u in range(t)])
                s = np.where(allowed[i, j], s, -np.inf)
                p = np.exp(s - s.max())
                ref[i, j, h] = (p / p.sum()) @ v[i, :, h // (H // K)]
    ours = attention.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(allowed), scale=scale,
                            softcap=cap)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    plain = attention.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(allowed), scale=scale)
    assert np.abs(np.asarray(plain) - ref).max() > 0.1  # the cap bites at these scores


def test_cudnn_cannot_softcap_and_falls_back_to_eager(caplog):
    assert attention.effective("cudnn", None) == "cudnn" and attention.effective("splash", 50.0) == "splash"
    attention._NOTED.clear()
    with caplog.at_level("WARNING"):
        assert attention.effective("cudnn", 50.0) == attention.effective("cudnn", 30.0) == "eager"
    assert caplog.text.count("cannot soft-cap") == 1  # one note per process


# ----------------------------------------------------------------------------------------------- the plain form
@pytest.mark.parametrize("impl, window, scale, softcap", [("splash", 5, None, None), ("cudnn", None, None, None),
                                                          ("splash", 3, 0.3, 2.0), ("cudnn", 4, 0.3, None)])
def test_causal_matches_eager_values_and_grads(impl, window, scale, softcap):
    """Left-padded GQA rows (20, 7 and 1 real tokens of 20), causal (within a window), values and the gradients
    of q, k and v under a loss on the real rows; Gemma's score scale and (splash) its soft-cap in the kernel."""
    rng = np.random.RandomState(0)
    b, t = 3, 20
    mask = jnp.asarray(_left_mask(t, [20, 7, 1]))
    pos = positions_from_mask(mask)
    q, k, v = _qkv(rng, b, t, H), _qkv(rng, b, t, K), _qkv(rng, b, t, K)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * mask[:, :, None, None]

    def run(name):  # noqa: ANN001, ANN202
        fn = attention.causal(mask, pos, implementation=name, window=window, dtype=jnp.float32, scale=scale,
                              softcap=softcap)
        out = jax.jit(fn)(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2)))(q, k, v)
        return out, grads

    (ours, g_ours), (ref, g_ref) = run(impl), run("eager")
    _assert_close(ours, ref, mask)
    for a, r in zip(g_ours, g_ref, strict=True):
        np.testing.assert_allclose(a, r, atol=TOL, rtol=TOL)
    assert float(jnp.max(jnp.abs(g_ref[1]))) > 0.5  # the keys get gradient: not trivially zero


# ----------------------------------------------------------------------------------------------- shared prompt
@pytest.mark.parametrize("impl, window, scale, softcap", [("splash", None, 0.3, 2.0), ("cudnn", 4, 0.3, None)])
def test_shared_prompt_matches_eager_values_and_grads(impl, window, scale, softcap):
    """B=2 left-padded prompts (6 and 3 real of 6) x G=3 completions of 5 (one ended after 2 tokens): the prompts'
    outputs, every completion token's joint softmax over its prompt and its own keys, and the gradients of all six
    inputs (the prompt K/V through every completion of its group); a score scale, and splash's soft-cap."""
    rng = np.random.RandomState(1)
    b, g, p, c = 2, 3, 6, 5
    pmask = jnp.asarray(_left_mask(p, [6, 3]))
    cmask = np.ones((b * g, c), np.int32)
    cmask[4, 2:] = 0
    cmask = jnp.asarray(cmask)
    p_pos = positions_from_mask(pmask)
    c_pos = jnp.repeat(pmask.sum(-1), g)[:, None] + jnp.cumsum(cmask, axis=-1) - 1
    args = (_qkv(rng, b, p, H), _qkv(rng, b * g, c, H), _qkv(rng, b, p, K), _qkv(rng, b, p, K),
            _qkv(rng, b * g, c, K), _qkv(rng, b * g, c, K))
    wp = jnp.asarray(rng.normal(size=args[0].shape), jnp.float32) * pmask[:, :, None, None]
    wc = jnp.asarray(rng.normal(size=args[1].shape), jnp.float32) * cmask[:, :, None, None]

    def run(name):  # noqa: ANN001, ANN202
        fn = attention.shared_prompt(pmask, p_pos, cmask, c_pos, implementation=name, window=window,
                                     dtype=jnp.float32, scale=scale, softcap=softcap)
        out = jax.jit(fn)(*args)

        def loss(*a):  # noqa: ANN002, ANN202
            op, oc = fn(*a)
            return jnp.sum(op * wp) + jnp.sum(oc * wc)

        return out, jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)

    ((op, oc), grads), ((rp, rc), ref_grads) = run(impl), run("eager")
    _assert_close(op, rp, pmask)
    _assert_close(oc, rc, cmask)
    for a, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, r, atol=TOL, rtol=TOL)
    assert float(jnp.max(jnp.abs(ref_grads[2]))) > 0.5  # the shared prompt keys get gradient from the completions


# ----------------------------------------------------------------------------------------------- attention sinks
def test_splash_sinks_match_eager_values_and_grads():
    """GPT-OSS's attention sinks (a logit per head in each softmax's denominator) in splash's kernel = the einsum's,
    values and the gradients of q, k, v and the sinks, for the causal form (left padding, a window) and the shared
    prompt form; the sinks change the output (the test could fail); cudnn with sinks is refused by name."""
    rng = np.random.RandomState(2)
    b, g, p, c = 2, 2, 6, 5
    pmask = jnp.asarray(_left_mask(p, [6, 3]))
    cmask = np.ones((b * g, c), np.int32)
    cmask[3, 2:] = 0
    cmask = jnp.asarray(cmask)
    p_pos = positions_from_mask(pmask)
    c_pos = jnp.repeat(pmask.sum(-1), g)[:, None] + jnp.cumsum(cmask, axis=-1) - 1
    args = (_qkv(rng, b, p, H), _qkv(rng, b * g, c, H), _qkv(rng, b, p, K), _qkv(rng, b, p, K),
            _qkv(rng, b * g, c, K), _qkv(rng, b * g, c, K), jnp.asarray(rng.normal(size=(H,)), jnp.float32))
    wp = jnp.asarray(rng.normal(size=args[0].shape), jnp.float32) * pmask[:, :, None, None]
    wc = jnp.asarray(rng.normal(size=args[1].shape), jnp.float32) * cmask[:, :, None, None]

    def run(name, window):  # noqa: ANN001, ANN202
        causal = attention.causal(pmask, p_pos, implementation=name, window=window, dtype=jnp.float32, sinks=True)
        shared = attention.shared_prompt(pmask, p_pos, cmask, c_pos, implementation=name, window=window,
                                         dtype=jnp.float32, sinks=True)

        def loss(qp, qc, pk, pv, gk, gv, sinks):  # noqa: ANN001, ANN202
            op, oc = shared(qp, qc, pk, pv, gk, gv, sinks)
            return jnp.sum(causal(qp, pk, pv, sinks) * wp) + jnp.sum(op * wp) + jnp.sum(oc * wc)

        outs = jax.jit(lambda *a: (causal(a[0], a[2], a[3], a[6]), *shared(*a)))(*args)
        return outs, jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*args)

    for window in (None, 3):
        (ours, g_ours), (ref, g_ref) = run("splash", window), run("eager", window)
        for o, r, m in zip(ours, ref, (pmask, pmask, cmask), strict=True):
            _assert_close(o, r, m)
        for a, r in zip(g_ours, g_ref, strict=True):
            np.testing.assert_allclose(a, r, atol=TOL, rtol=TOL)
        assert float(jnp.max(jnp.abs(g_ref[6]))) > 0.1  # the sinks get gradient
    plain = attention.causal(pmask, p_pos, implementation="eager", window=None, dtype=jnp.float32)
    moved = np.abs(np.asarray(plain(args[0], args[2], args[3]) - ref[0]))[np.asarray(pmask, bool)].max()
    assert moved > 0.05, moved
    with pytest.raises(ValueError, match="attn_implementation='cudnn' cannot compute attention sinks"):
        attention.causal(pmask, p_pos, implementation="cudnn", window=None, dtype=jnp.float32, sinks=True)


# ----------------------------------------------------------------------------------------------- refusals
def test_cudnn_call_needs_a_gpu_here():
    """The `cudnn` path's call is jax's cuDNN kernel: off a GPU the program cannot be built (the same call through
    XLA is what the tests above check)."""
    x = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(Exception):  # noqa: B017, PT011 - jax raises its own error types for a missing cuDNN
        jax.jit(lambda a: attention.cudnn_attention(a, a, a, jnp.ones((1, 8), jnp.int32)))(x).block_until_ready()


@pytest.mark.parametrize("extra, message", [
    (["--attn_implementation", "cudnn"], "attn_implementation='cudnn' is not available on cpu; valid there: eager "),
    (["--attn_implementation", "splash"], "attn_implementation='splash' is not available on cpu; valid there: eager "),
    (["--attn_implementation", "cudnn", "--compile_only", "--topology", "v5e-4", "--max_prompt_length", "16"],
     "attn_implementation='cudnn' is not available on tpu; valid there: eager, splash "),
])
def test_unavailable_implementation_exits_2(tmp_path, capsys, tiny_checkpoint, extra, message):
    from rloo_jax.cli import main

    model = tiny_checkpoint("qwen2_tied")
    capsys.readouterr()  # building it (first use) writes progress bars
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(data),
            "--reward_funcs", "format", "--output_dir", str(tmp_path / "out"), "--compilation_cache", "false", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "--attn_implementation" in err
    assert err.count("\n") == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- on a mesh
MESH_WORKER = r'''
import json, jax, jax.numpy as jnp, numpy as np
from rloo_jax.mesh import make_mesh
from rloo_jax.models import attention
from rloo_jax.models.transformer import positions_from_mask
rng = np.random.RandomState(2)
b, t, h, k, dh = 4, 12, 4, 2, 16
mask = np.zeros((b, t), np.int32)
for i, n in enumerate([12, 5, 9, 1]):
    mask[i, t - n:] = 1
mask = jnp.asarray(mask)
q, kk, v = (jnp.asarray(rng.normal(size=(b, t, n, dh)), jnp.float32) for n in (h, k, k))
w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * mask[:, :, None, None]
sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
out = {}
for shape in [(2, 2, 2), (1, 2, 4)]:  # heads over tensor (4 query, 2 kv heads over 2); over 4: not split
    mesh = make_mesh(*shape)
    for name in ("splash", "eager"):
        for with_sinks in (False, True):  # GPT-OSS's attention sinks: split over heads with them
            fn = attention.causal(mask, positions_from_mask(mask), implementation=name, window=None,
                                  dtype=jnp.float32, sinks=with_sinks)
            args = (q, kk, v, sinks) if with_sinks else (q, kk, v)
            with jax.set_mesh(mesh):
                o = jax.jit(fn)(*args)
                g = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=tuple(range(len(args)))))(*args)
            out[f"{shape}/{name}/{with_sinks}"] = [np.asarray(o)[np.asarray(mask) > 0].tolist(),
                                                   [np.asarray(x).tolist() for x in g]]
print("RESULT " + json.dumps(out))
'''


def test_splash_inside_shard_map_on_a_mesh():
    """8 forced CPU devices, rows over data x fsdp and heads over tensor (and a tensor size that does not divide the
    kv heads: heads then stay whole): the kernel inside `shard_map` gives the einsum's values and gradients, with and
    without attention sinks (theirs included)."""
    env = dict(os.environ, XLA_FLAGS=forced_devices(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", MESH_WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    for shape in ["(2, 2, 2)", "(1, 2, 4)"]:
        for with_sinks in (False, True):
            (o, g), (ro, rg) = out[f"{shape}/splash/{with_sinks}"], out[f"{shape}/eager/{with_sinks}"]
            np.testing.assert_allclose(o, ro, atol=TOL, rtol=TOL)
            for a, r in zip(g, rg, strict=True):
                np.testing.assert_allclose(a, r, atol=TOL, rtol=TOL)
