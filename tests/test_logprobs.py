"""Per-token log-probs, entropy and completion masks: hand goldens, NumPy oracles, two paths that agree."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rloo_jax as rj


def _np_logps(logits, ids, temperature):
    x = logits.astype(np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return np.take_along_axis(logp, ids[..., None], -1)[..., 0]


def test_per_token_logps_hand_golden():
    logits = jnp.log(jnp.array([[[0.25, 0.75], [0.5, 0.5]]]))
    out = rj.per_token_logps(logits, jnp.array([[1, 0]]))
    np.testing.assert_allclose(out, [[math.log(0.75), math.log(0.5)]], rtol=1e-6)
    # temperature 2 on log-probs [log .25, log .75]: softmax of halves -> sqrt weights
    out_t = rj.per_token_logps(logits, jnp.array([[1, 0]]), temperature=2.0)
    p1 = math.sqrt(0.75) / (math.sqrt(0.25) + math.sqrt(0.75))
    np.testing.assert_allclose(out_t[0, 0], math.log(p1), rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_per_token_logps_matches_numpy(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 37)).astype(np.float32) * 3
    ids = rng.integers(0, 37, size=(3, 5))
    out = jax.jit(rj.per_token_logps, static_argnums=2)(logits, ids, temperature)
    np.testing.assert_allclose(out, _np_logps(logits, ids, temperature), atol=1e-5)
    assert out.dtype == jnp.float32


def test_per_token_logps_bf16_logits_computed_in_f32():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 4, 50)) * 4, jnp.bfloat16)
    ids = rng.integers(0, 50, size=(2, 4))
    out = rj.per_token_logps(logits, ids)
    ref = _np_logps(np.asarray(logits.astype(jnp.float32)), ids, 1.0)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_per_token_logps_rejects_shape_mismatch():
    with pytest.raises(AssertionError):
        rj.per_token_logps(jnp.zeros((2, 4, 5)), jnp.zeros((2, 3), jnp.int32))


def test_entropy_golden_and_oracle():
    v = 8
    np.testing.assert_allclose(rj.entropy_from_logits(jnp.zeros((1, v))), [math.log(v)], rtol=1e-6)
    # one-hot-ish distribution -> ~0
    assert float(rj.entropy_from_logits(jnp.array([[100.0, 0.0, 0.0]]))[0]) < 1e-6
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32)
    for t in (1.0, 0.5):
        x = logits / t
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = -(p * np.log(p)).sum(-1)
        np.testing.assert_allclose(rj.entropy_from_logits(logits, t), want, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_logps_from_hidden_equals_full_logits_path(chunk):
    rng = np.random.default_rng(3)
    b, t, d, v = 2, 7, 6, 23
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    unembed = lambda h: h @ w  # noqa: E731
    full = rj.per_token_logps(unembed(hidden), ids, 0.8)
    lp, ent = rj.per_token_logps_from_hidden(hidden, unembed, ids, 0.8, chunk_size=chunk, with_entropy=True)
    np.testing.assert_allclose(lp, full, atol=1e-5)
    np.testing.assert_allclose(ent, rj.entropy_from_logits(unembed(hidden), 0.8), atol=1e-5)

    # gradients w.r.t. hidden and the head agree too
    def f_full(h, w):
        return jnp.sum(rj.per_token_logps(h @ w, ids, 0.8) * jnp.arange(t))

    def f_chunk(h, w):
        return jnp.sum(rj.per_token_logps_from_hidden(h, lambda x: x @ w, ids, 0.8, chunk_size=chunk) * jnp.arange(t))

    g1 = jax.grad(f_full, argnums=(0, 1))(hidden, w)
    g2 = jax.jit(jax.grad(f_chunk, argnums=(0, 1)))(hidden, w)
    for a, b_ in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_frozen_unembed_gives_the_same_logps_and_hidden_gradient_with_two_matmuls(chunk):
    """LoRA's frozen head: the hidden state's gradient computed in the forward pass equals autodiff's, and the
    jitted gradient does two [T, D] x [D, V] matmuls instead of three (no logits recomputed in the backward)."""
    from rloo_jax import hlo

    rng = np.random.default_rng(4)
    b, t, d, v = 2, 7, 6, 23
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))

    def logps(h, frozen):
        return rj.per_token_logps_from_hidden(h, lambda x: x @ w, ids, 0.8, chunk_size=chunk, with_entropy=True,
                                              frozen_unembed=frozen)

    def loss(h, frozen):
        return jnp.sum(logps(h, frozen)[0] * jnp.arange(t))

    want, got = jax.jit(lambda h: logps(h, False))(hidden), jax.jit(lambda h: logps(h, True))(hidden)
    np.testing.assert_array_equal(got[0], want[0])  # the same forward ops: the same bits
    np.testing.assert_array_equal(got[1], want[1])
    grads = [jax.jit(jax.grad(loss), static_argnums=1)(hidden, f) for f in (False, True)]
    np.testing.assert_allclose(grads[1], grads[0], atol=1e-5)  # measured 1.9e-6: the product order differs
    assert np.abs(grads[0]).max() > 0.1
    # a loop over 3 chunks: matmul FLOPs of the compiled value-and-gradient program, 3 : 2 (hlo.flops counts XLA's
    # dot instructions, as CPU and TPU programs have them; a GPU program calls cuBLAS instead)
    if chunk == 3 and jax.default_backend() != "gpu":
        flops = [hlo.flops(jax.jit(jax.value_and_grad(loss), static_argnums=1).lower(hidden, f).compile().as_text())
                 for f in (False, True)]
        assert flops[0] == 1.5 * flops[1] > 0


def test_logps_from_hidden_peak_memory_is_chunked():
    """The chunked pass must not allocate the [B, T, V] float32 logits (the point of the function): growing the
    vocabulary 4x grows the naive program's scratch memory by at least the logits' growth, the chunked one's by
    under 1/8 of it. Differences, as a GPU program's scratch also holds cuBLAS's fixed workspace (32 MiB)."""
    b, t, d = 2, 256, 16

    def temp(fn, v):
        shapes = [jax.ShapeDtypeStruct(s, x) for s, x in [((b, t, d), jnp.float32), ((d, v), jnp.float32),
                                                           ((b, t), jnp.int32)]]
        return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    def chunked(h, w, i):
        return rj.per_token_logps_from_hidden(h, lambda x: x @ w, i, chunk_size=16)

    def full(h, w, i):
        return rj.per_token_logps(h @ w, i)

    grown = b * t * (4 * 4096 - 4096) * 4  # the float32 logits' growth, 4096 -> 16384 entries
    grown_c, grown_f = (temp(fn, 4 * 4096) - temp(fn, 4096) for fn in (chunked, full))
    assert grown_f >= grown  # sanity: the naive path does hold the logits
    assert grown_c <= grown / 8, (grown_c, grown)


def _loop_completion_mask(ids, eos, pad):
    masks, trunc = [], []
    for row in ids:
        m, end = [], None
        for t, tok in enumerate(row):
            m.append(1 if end is None else 0)
            if end is None and tok in eos:
                end = t
        masks.append(m)
        last = row[end] if end is not None else row[-1]
        trunc.append(not (last in eos or last == pad))
    return np.array(masks), np.array(trunc)


def test_completion_mask_goldens_and_oracle():
    ids = jnp.array([[5, 2, 0, 0], [5, 6, 7, 8], [3, 3, 3, 2], [2, 9, 9, 9]])
    mask, trunc = rj.completion_mask(ids, (2,), pad_token_id=0)
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    np.testing.assert_array_equal(trunc, [False, True, False, False])

    rng = np.random.default_rng(4)
    ids = rng.integers(0, 8, size=(64, 6))
    for eos in [(1,), (1, 4), (7, 3, 5)]:
        mask, trunc = jax.jit(rj.completion_mask, static_argnums=(1, 2))(jnp.asarray(ids), eos, 0)
        want_m, want_t = _loop_completion_mask(ids.tolist(), eos, 0)
        np.testing.assert_array_equal(mask, want_m)
        np.testing.assert_array_equal(trunc, want_t)


def test_completion_mask_several_eos_ids_first_one_wins():
    ids = jnp.array([[4, 9, 7, 9]])
    mask, trunc = rj.completion_mask(ids, (7, 9))
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0]])
    assert not bool(trunc[0])


def test_completion_mask_pad_at_end_is_not_truncated():
    # TRL: is_truncated = ids[-1] not in (*eos, pad)
    _, trunc = rj.completion_mask(jnp.array([[4, 5, 0]]), (2,), pad_token_id=0)
    assert not bool(trunc[0])
    _, trunc = rj.completion_mask(jnp.array([[4, 5, 0]]), (2,), pad_token_id=None)
    assert bool(trunc[0])
