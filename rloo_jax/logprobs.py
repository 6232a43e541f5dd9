"""Per-token log-probabilities, entropies and completion masks.

All functions are pure and jittable. Log-softmax is always taken in float32 over the full vocabulary of
``logits / temperature`` (TRL semantics: sampling filters such as top-k/top-p never touch the log-probs).

Shapes: N rows (completions), T positions, V vocabulary, D hidden size, C completion length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import chex
import jax
import jax.numpy as jnp

from rloo_jax.mesh import LOGICAL_RULES, constrain

Array = jax.Array

VOCAB_PARALLEL = {**LOGICAL_RULES, "vocab": ("data", "fsdp", "tensor")}
"""The log-prob pass's rule table: the logits' vocabulary split over every device (``per_token_logps_from_hidden``)."""


def _scaled(logits: Array, temperature: float) -> Array:
    return logits.astype(jnp.float32) / temperature


def per_token_logps(logits: Array, token_ids: Array, temperature: float = 1.0) -> Array:
    """Log-probability of each chosen token: ``log_softmax(logits / T)[b, t, token_ids[b, t]]``.

    Computed as ``x[id] - logsumexp(x)`` with ``x = float32(logits) / T``, so no float32 copy of the full
    ``[N, T, V]`` log-softmax is materialised (XLA fuses the cast, scale and reduction).

    Args:
      logits: ``[N, T, V]`` (any float dtype); ``logits[:, t]`` scores ``token_ids[:, t]``.
      token_ids: ``[N, T]`` integer ids.
      temperature: the sampling temperature (> 0); the same value must be used for policy, old and reference.

    Returns:
      ``[N, T]`` float32.

    Example: ``per_token_logps(jnp.log(jnp.array([[[0.25, 0.75]]])), jnp.array([[1]]))`` -> ``[[-0.2877]]``.
    """
    chex.assert_rank(logits, token_ids.ndim + 1)
    chex.assert_equal_shape_prefix((logits, token_ids), token_ids.ndim)
    x = _scaled(logits, temperature)
    picked = jnp.take_along_axis(x, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def entropy_from_logits(logits: Array, temperature: float = 1.0) -> Array:
    """Entropy of ``softmax(logits / T)`` at each position: ``H = logsumexp(x) - sum_v softmax(x)_v x_v``.

    Args:
      logits: ``[..., V]``.
      temperature: > 0.

    Returns:
      ``[...]`` float32. A uniform distribution over V gives ``log(V)``.
    """
    x = _scaled(logits, temperature)
    lse = jax.nn.logsumexp(x, axis=-1)
    p = jnp.exp(x - lse[..., None])
    return lse - jnp.sum(p * x, axis=-1)


def per_token_logps_from_hidden(
    hidden: Array,
    unembed: Callable[[Array], Array],
    token_ids: Array,
    temperature: float = 1.0,
    *,
    chunk_size: int = 64,
    with_entropy: bool = False,
    frozen_unembed: bool = False,
    entropy_grad: bool = False,
) -> Array | tuple[Array, Array]:
    """Per-token log-probs straight from hidden states, never holding the full ``[N, T, V]`` logits.

    The sequence axis is cut into chunks of ``chunk_size`` positions; each chunk is unembedded, reduced to
    ``x[id] - logsumexp(x)`` and dropped. The chunk function is rematerialised (``jax.checkpoint``) so the backward
    pass also holds one chunk of logits at a time: peak extra memory is ``N * chunk_size * V`` floats instead of
    ``N * T * V``.

    On a mesh the logits are vocabulary-parallel: every row of a chunk on every device, the vocabulary split over
    all of them (``VOCAB_PARALLEL``). The unembedding weight is multiplied where it lies (its FSDP shards split
    anew, never gathered whole) and each device's part of its gradient is its own; with the chunk's rows split
    over the data shards instead, every device gathered the whole ``[D, V]`` weight for every chunk and, training
    it, held and all-reduced a whole ``[D, V]`` gradient per chunk (BENCHMARKS.md).

    ``frozen_unembed``: the unembedding's weights get no gradient (LoRA: the head is part of the frozen base), so
    the only gradient is the hidden state's, ``d logp / d h = unembed^T((onehot(id) - softmax(x)) / T)``, a
    ``[D]`` vector per position that needs no upstream cotangent: each chunk computes it in the forward pass,
    beside its logits (``_with_grad``), and the backward pass only scales it. Two unembedding matmuls per
    position instead of three (forward, the backward's recomputed logits and their transpose); the values are
    the same, and so is the gradient up to the order of one product.

    Args:
      hidden: ``[N, T, D]`` final hidden states (after the final norm).
      unembed: ``h [..., D] -> logits [..., V]`` (the model's lm head; a closure over its parameters).
      token_ids: ``[N, T]``; ``hidden[:, t]`` predicts ``token_ids[:, t]``.
      temperature: > 0.
      chunk_size: positions per chunk (T is padded up to a multiple internally).
      with_entropy: also return the entropy ``[N, T]``.
      entropy_grad: the entropy carries its gradient (an entropy bonus in the loss); else it is a metric only,
        with no gradient (and no backward pass of its own). With ``frozen_unembed`` its gradient with respect to the
        hidden state, ``unembed^T(-p (log p + H) / T)``, is computed in the forward pass too.

    Returns:
      ``[N, T]`` float32 log-probs, or ``(logps, entropy)`` when ``with_entropy``.
    """
    chex.assert_rank(hidden, 3)
    chex.assert_rank(token_ids, 2)
    b, t, d = hidden.shape
    chunk = max(1, min(chunk_size, t))
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    ids = jnp.pad(token_ids, ((0, 0), (0, pad)))
    h = h.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, N, chunk, D]
    ids = ids.reshape(b, n, chunk).swapaxes(0, 1)

    def logits_of(hc: Array) -> Array:
        return constrain(unembed(constrain(hc, (None, None, None))), (None, None, "vocab"), VOCAB_PARALLEL)

    def rows(x: Array) -> Array:  # back to rows over the data shards
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def entropy(logits: Array, lp: Array) -> Array:
        if not with_entropy:
            return jnp.zeros_like(lp)
        return entropy_from_logits(logits if entropy_grad else jax.lax.stop_gradient(logits), temperature)

    @jax.checkpoint
    def one(args: tuple[Array, Array]) -> tuple[Array, Array]:
        hc, idc = args
        logits = logits_of(hc)
        lp = per_token_logps(logits, idc, temperature)
        return rows(lp), rows(entropy(logits, lp))

    def one_frozen(args: tuple[Array, Array]) -> tuple[Array, Array]:
        hc, idc = args
        logits, transpose = jax.vjp(logits_of, jax.lax.stop_gradient(hc))
        lp = per_token_logps(logits, idc, temperature)
        x = _scaled(logits, temperature)
        probs = jnp.exp(x - jax.nn.logsumexp(x, axis=-1, keepdims=True))
        picked = jax.nn.one_hot(idc, logits.shape[-1], dtype=jnp.float32)
        (grad,) = transpose(((picked - probs) / temperature).astype(logits.dtype))  # d lp / d hc [B, chunk, D]
        grad = rows(jax.lax.stop_gradient(grad))
        lp = _with_grad(rows(jax.lax.stop_gradient(lp)), hc, grad)
        if not (with_entropy and entropy_grad):
            return lp, rows(entropy(logits, lp))
        h = jax.lax.stop_gradient(entropy(logits, lp))
        log_p = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
        (h_grad,) = transpose((-probs * (log_p + h[..., None]) / temperature).astype(logits.dtype))  # d H / d hc
        return lp, _with_grad(rows(h), hc, rows(jax.lax.stop_gradient(h_grad)))

    lp, ent = jax.lax.map(one_frozen if frozen_unembed else one, (h, ids))
    lp = lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    if not with_entropy:
        return lp
    return lp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


@jax.custom_vjp
def _with_grad(value: Array, x: Array, grad: Array) -> Array:
    """``value`` [...], whose derivative with respect to ``x`` [..., D] is ``grad`` [..., D] (computed by the
    caller, e.g. in a forward pass): the backward pass returns ``cotangent[..., None] * grad`` for ``x``. ``value``
    and ``grad`` themselves carry no gradient (stop them before)."""
    return value


def _with_grad_fwd(value: Array, x: Array, grad: Array) -> tuple[Array, Array]:
    return value, grad.astype(x.dtype)


def _with_grad_bwd(grad: Array, ct: Array) -> tuple[Array, Array, Array]:
    return jnp.zeros_like(ct), (ct[..., None] * grad).astype(grad.dtype), jnp.zeros_like(grad)


_with_grad.defvjp(_with_grad_fwd, _with_grad_bwd)


def completion_mask(
    completion_ids: Array, eos_token_ids: Sequence[int] | Array, pad_token_id: int | None = None
) -> tuple[Array, Array]:
    """Mask of the real completion tokens and the truncation flag, as TRL computes them.

    ``mask[b, t] = 1`` for ``t <= first EOS position`` (the EOS itself counts; any id in ``eos_token_ids`` is an
    EOS), all ones when the row has no EOS. ``is_truncated[b]`` is true when the last kept token is neither an EOS
    nor ``pad_token_id`` (TRL: ``ids[-1] not in eos_and_pad``), i.e. the row hit the length limit.

    Args:
      completion_ids: ``[N, C]`` right-padded completions.
      eos_token_ids: one or more EOS ids.
      pad_token_id: the pad id, or None.

    Returns:
      ``(mask [N, C] int32, is_truncated [N] bool)``.

    Example: ids ``[[5, 2, 0, 0], [5, 6, 7, 8]]``, eos ``(2,)`` -> mask ``[[1, 1, 0, 0], [1, 1, 1, 1]]``,
    truncated ``[False, True]``.
    """
    chex.assert_rank(completion_ids, 2)
    eos = jnp.atleast_1d(jnp.asarray(eos_token_ids, dtype=completion_ids.dtype))
    c = completion_ids.shape[1]
    is_eos = jnp.any(completion_ids[..., None] == eos, axis=-1)  # [N, C]
    pos = jnp.arange(c)
    first_eos = jnp.min(jnp.where(is_eos, pos, c), axis=1)  # C when there is none
    mask = (pos[None, :] <= first_eos[:, None]).astype(jnp.int32)
    last_kept = jnp.take_along_axis(completion_ids, jnp.minimum(first_eos, c - 1)[:, None], axis=1)[:, 0]
    ends_ok = jnp.any(last_kept[:, None] == eos, axis=-1)
    if pad_token_id is not None:
        ends_ok = ends_ok | (last_kept == pad_token_id)
    return mask, ~ends_ok


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x * mask) / max(sum(mask), 1)`` along ``axis`` (0 where the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)
