"""Attention for the training forwards and the prefill: the einsum reference and fused kernels, one entry point.

`attn_implementation` (transformers' option name; a `ModelConfig` field and a run option) picks how the masked
softmax(q k^T / sqrt(Dh)) v of a forward is computed:

- `eager`: einsums with a float32 [B, heads, T, S] score matrix in memory (`attend`, `attend_shared_prompt`): the
  reference the kernels are tested against, and the decode step's attention everywhere (one query per row:
  bandwidth-bound, its scores [N, heads, 1, P + C] are small next to the KV cache it reads).
- `splash`: Pallas TPU splash attention (shipped in jax): flash attention over blocks, skipping the blocks the
  static causal (and sliding-window) mask hides; padding is masked by per-row segment ids. No [T, S] matrix is ever
  in HBM, forward or backward. On a mesh it runs inside `shard_map` (rows over data x fsdp, heads over tensor),
  as Mosaic kernels cannot be partitioned automatically. Off a TPU it runs interpreted (tests).
- `cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16). Its padding arguments
  mean right padding only and a boolean mask becomes a materialised bias, so rows are rotated instead: each row's
  real tokens (one contiguous run: left- and/or right-padded) moved to the front, a plain causal mask, rotated back.
  Off a GPU the same call runs through XLA (tests).

None resolves for the platform the program is compiled for (`resolve`): splash on TPU, cudnn on GPU with bf16/fp16
compute (unless XLA's deterministic GPU ops are on), eager otherwise.

Every form takes the model's score scale (`scale`: head_dim ** -0.5, Gemma's query_pre_attn_scalar ** -0.5) and
its attention soft-capping (`softcap`, Gemma 2: scores -> cap * tanh(scores / cap) before the mask), and each
layer its own sliding window (`window`; Gemma's alternating local/global layers build one function per window,
`Transformer.attention_fns`). Splash soft-caps inside its kernel; cuDNN's flash attention cannot (jax's
`dot_product_attention` has no soft-cap), so a soft-capped model's layers fall back to eager under `cudnn`
(`effective`; one note in the log).

Attention sinks (GPT-OSS): a learned logit per query head joins each softmax's denominator and nothing else,
p_s = exp(s_s) / (sum_s' exp(s_s') + exp(sink_h)). The eager forms and splash (its kernel's `sinks`) take them
(`sinks` [H]); cuDNN's (jax's `dot_product_attention`) cannot, so a model with sinks runs eager where the platform's
choice would be cudnn and refuses cudnn asked for by name (`_resolved`; `ModelConfig` refuses it at load).

Two forms, built once per forward (masks, segment ids, rotations; outside the layer loop) and called per layer:

- `causal(mask, positions)`: rows of T tokens with any padding, causal self-attention (prefill, reward models).
- `shared_prompt(prompt_mask, ...)`: B prompts each continued by G completions (`Transformer.forward_shared_prompt`):
  the prompts' causal self-attention, and each completion row's joint softmax over its prompt's keys (computed once
  per prompt) plus its own earlier keys. For the kernels each completion row's keys are [its prompt's keys; its own
  keys] (the prompt K/V repeated G times: N x P rows, small next to the scores the einsum held; gradients reach the
  shared prompt K/V through the repeat), queries its C tokens, causal with the offset P.

Shapes: B prompts (or rows), T tokens, P prompt, C completion, N = B*G completion rows, H query heads, K kv heads,
Dh head dim, S keys. Query head h uses kv head h // (H / K) (HF `repeat_kv` order).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from rloo_jax.efficiency import attention_kernel_flops, block_sparse_pairs
from rloo_jax.hlo import kernel_flops_scope
from rloo_jax.mesh import fit_spec

logger = logging.getLogger(__name__)
_NOTED: dict[str, bool] = {}  # notes logged once per process

IMPLEMENTATIONS = ("eager", "splash", "cudnn")
AVAILABLE: dict[str, tuple[str, ...]] = {"cpu": ("eager",), "gpu": ("eager", "cudnn"), "tpu": ("eager", "splash")}
_NEG = -1e30  # finite "minus infinity": a fully masked (padding) query row gives a uniform softmax, not NaN
_LANES = 128  # splash's block sizes are multiples of the TPU's 128 lanes
_MAX_BLOCK = 512  # splash block (queries and keys) for long rows: MaxText's default

# ----------------------------------------------------------------------------------------------- choosing one
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("rloo_jax_attention_target", default=None)


@contextlib.contextmanager
def compile_target(platform: str) -> Iterator[None]:
    """Trace for `platform` ("tpu", "gpu", "cpu") whatever the default backend: `--compile_only` traces on the CPU
    for a TPU, where splash must be lowered for Mosaic, not interpreted."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """The platform programs traced now are compiled for: `compile_target`'s, else jax's default backend."""
    return _TARGET.get() or jax.default_backend()


def resolve(implementation: str | None, platform: str, dtype: str, deterministic: bool = False) -> str:
    """The implementation to run: `implementation`, or for None the best available on `platform` for the compute
    `dtype`. ValueError (one line naming the valid values there) for one the platform does not offer.

    `deterministic`: XLA's deterministic GPU ops are on (`rloo_jax.numerics.determinism_enabled`). cuDNN's
    attention is then not chosen, and refused when asked for: with them, XLA (jaxlib 0.11.2 on an H200) failed
    executing the update programs of a PPO run and of an accumulation that carries micro-batches ("IndexError:
    absl::container_internal::raw_hash_map<>::at"); the same runs with eager attention, or without the flag, ran.

    Example: resolve(None, "tpu", "float32") -> "splash"; resolve(None, "gpu", "float32") -> "eager" (cuDNN's
    flash attention takes bf16/fp16 only); resolve(None, "gpu", "bfloat16", deterministic=True) -> "eager";
    resolve("cudnn", "tpu", ...) -> ValueError.
    """
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    valid = AVAILABLE.get(platform, ("eager",))
    if implementation is None:
        if platform == "tpu":
            return "splash"
        fused = platform == "gpu" and dtype in ("bfloat16", "float16") and not deterministic
        return "cudnn" if fused else "eager"
    if implementation not in valid:
        raise ValueError(f"attn_implementation={implementation!r} is not available on {platform}; valid there: "
                         f"{', '.join(valid)} (None: the best of them)")
    if implementation == "cudnn" and dtype not in ("bfloat16", "float16"):
        raise ValueError(f"attn_implementation='cudnn' needs bf16/fp16 compute (cuDNN's flash attention); the compute "
                         f"dtype is {dtype}: use bf16 or attn_implementation='eager'")
    if implementation == "cudnn" and platform == "gpu" and deterministic:
        raise ValueError("attn_implementation='cudnn' does not run under XLA's deterministic GPU ops "
                         "(full_determinism, or --xla_gpu_deterministic_ops=true in XLA_FLAGS): XLA fails executing "
                         "its update programs; use attn_implementation='eager' or full_determinism false")
    return implementation


def effective(implementation: str, softcap: float | None) -> str:
    """What runs a layer asked to run `implementation`: eager instead of cudnn for soft-capped attention (cuDNN's
    flash attention through jax has no soft-cap; splash has one). Example: effective("cudnn", 50.0) -> "eager"."""
    if implementation == "cudnn" and softcap is not None:
        if not _NOTED.get("cudnn_softcap"):
            _NOTED["cudnn_softcap"] = True
            logger.warning("note: attn_implementation cudnn cannot soft-cap attention scores (Gemma 2's "
                           "attn_logit_softcapping): those layers run eager attention")
        return "eager"
    return implementation


def _resolved(implementation: str | None, dtype: jnp.dtype, softcap: float | None = None, sinks: bool = False) -> str:
    """At trace time, for the platform compiled for (no availability check: the run config did it); then
    `effective` for the model's soft-capping. `sinks` (attention sinks): eager or splash, which compute them;
    ValueError for cudnn asked for by name, eager where the platform's choice is cudnn."""
    if sinks and implementation == "cudnn":
        raise ValueError("attn_implementation='cudnn' cannot compute attention sinks (GPT-OSS); use "
                         "attn_implementation='eager'")
    if implementation is None:
        implementation = resolve(None, target_platform(), jnp.dtype(dtype).name)
        implementation = "eager" if sinks and implementation == "cudnn" else implementation
    return effective(implementation, softcap)


# ----------------------------------------------------------------------------------------------- eager (reference)
def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """Sliding-window part of the mask: q_pos - k_pos < window (all True without a window)."""
    if window is None:
        return jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    return q_pos - k_pos < window


def _scores(s: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    """Raw float32 scores q k^T -> scale * them, soft-capped: cap * tanh(scale * s / cap) (HF's order)."""
    s = s * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def sink_softmax(s: jax.Array, sink: jax.Array | None) -> jax.Array:
    """softmax over the last axis with an extra logit `sink` in the denominator only (GPT-OSS's attention sinks:
    transformers concatenates it, softmaxes, drops it): exp(s - m) / (sum exp(s - m) + exp(sink - m)),
    m = max(max s, sink), float32. s [..., S], sink broadcastable to s[..., :1] (None: the plain softmax).
    Example: s [0, 0], sink 0 -> [1/3, 1/3]."""
    if sink is None:
        return jax.nn.softmax(s, axis=-1)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), s[..., :1].shape)
    m = jnp.maximum(s.max(-1, keepdims=True), sink)
    e = jnp.exp(s - m)
    return e / (e.sum(-1, keepdims=True) + jnp.exp(sink - m))


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float | None = None,
    softcap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention: softmax(cap(scale q k^T) masked) v, softmax in float32; scale defaults to
    Dh ** -0.5, cap(s) = softcap * tanh(s / softcap) (identity for softcap None); `sinks` [H]: each head's sink
    logit in its softmax's denominator (`sink_softmax`).

    q [B, T, H, Dh], k/v [B, S, K, Dh], allowed [B, T, S] bool -> [B, T, H, Dh]. Query head h uses kv head
    h // (H / K) (HF `repeat_kv` order), done by a reshape instead of repeating k/v.
    """
    b, t, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = _scores(s, dh**-0.5 if scale is None else scale, softcap)
    s = jnp.where(allowed[:, None, None], s, _NEG)
    sink = None if sinks is None else sinks.reshape(kh, h // kh)[None, :, :, None, None]
    p = sink_softmax(s, sink).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v)
    return o.reshape(b, t, h, dh)


def attend_shared_prompt(
    q: jax.Array,
    pk: jax.Array,
    pv: jax.Array,
    p_allowed: jax.Array,
    gk: jax.Array,
    gv: jax.Array,
    g_allowed: jax.Array,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """T queries per row over its prompt's shared keys plus its own keys, one joint softmax (f32) of the scaled,
    soft-capped scores (as `attend`; `sinks` [H] in its denominator, `sink_softmax`).

    q [B, G, T, H, Dh]; prompt pk/pv [B, K, P, Dh] (NOT repeated G times), p_allowed [B, G, T, P];
    own keys gk/gv [N, K, S, Dh] with N = B*G rows (row n continues prompt n // G), g_allowed [B, G, T, S]
    ->  [B, G, T, H, Dh].
    Keys are kv-head-major ([.., K, S, Dh]) so both score contractions have ([b, g] or n, k) as batch dimensions
    with each head's keys contiguous. The own keys keep one row axis: a decode step's dots then read its layer of
    the stacked [L, N, K, C, Dh] cache in place, where splitting the rows into (b, g) made the TPU compiler copy
    each layer's slice first (BENCHMARKS.md, "Decode reads the KV cache in place").
    Decoding uses T = 1 and S = C cache slots; the eager training forward uses T = S = C completion tokens.
    """
    b, g, t, h, dh = q.shape
    kh = pk.shape[1]
    qg = q.reshape(b, g, t, kh, h // kh, dh)
    scale = dh**-0.5 if scale is None else scale
    sp = _scores(jnp.einsum("bgtkhd,bkpd->bgkhtp", qg, pk, preferred_element_type=jnp.float32), scale, softcap)
    sc = jnp.einsum("ntkhd,nksd->nkhts", qg.reshape(b * g, *qg.shape[2:]), gk, preferred_element_type=jnp.float32)
    sc = _scores(sc.reshape(b, g, *sc.shape[1:]), scale, softcap)
    sp = jnp.where(p_allowed[:, :, None, None], sp, _NEG)
    sc = jnp.where(g_allowed[:, :, None, None], sc, _NEG)
    m = jnp.maximum(sp.max(-1, keepdims=True), sc.max(-1, keepdims=True))
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kh, h // kh)[:, :, None, None]
    m = m if sink is None else jnp.maximum(m, sink)
    ep, ec = jnp.exp(sp - m), jnp.exp(sc - m)
    z = ep.sum(-1, keepdims=True) + ec.sum(-1, keepdims=True)
    z = z if sink is None else z + jnp.exp(sink - m)
    o = jnp.einsum("bgkhtp,bkpd->bgtkhd", (ep / z).astype(pv.dtype), pv)
    pc = (ec / z).reshape(b * g, *ec.shape[2:]).astype(gv.dtype)
    o = o + jnp.einsum("nkhts,nksd->ntkhd", pc, gv).reshape(o.shape)
    return o.reshape(b, g, t, h, dh)


def causal_allowed(mask: jax.Array, positions: jax.Array, window: int | None) -> jax.Array:
    """The eager mask of causal self-attention over padded rows: key s visible to query t iff s <= t, s is a real
    token and (with a window) pos_t - pos_s < window. mask, positions [B, T] -> [B, T, T] bool."""
    idx = jnp.arange(mask.shape[1])
    allowed = (idx[:, None] >= idx[None, :])[None] & (mask[:, None, :] > 0)
    return allowed & visible(positions[:, :, None], positions[:, None, :], window)


# ----------------------------------------------------------------------------------------------- splash (TPU)
def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _block(n: int) -> int:
    """The largest splash block (a multiple of the 128 lanes, at most 512) dividing n (a multiple of 128)."""
    return next(blk for blk in range(_MAX_BLOCK, 0, -_LANES) if n % blk == 0)


def splash_layout(t: int, s: int) -> tuple[int, int, int, int]:
    """How `splash_attention` pads a call of T queries over S keys: (query block, key block, padded T, padded S).
    Queries are padded at the end to a multiple of 128; keys at the end to a multiple of 128 and by as many as the
    queries (each padded query keeps its own padded key); each block is the largest of 512, 384, 256, 128 that
    divides its padded length.

    Example: splash_layout(8192, 8448) -> (512, 384, 8192, 8448); splash_layout(5, 11) -> (128, 256, 128, 256).
    """
    tp = _round_up(t, _LANES)
    sp = _round_up(s + tp - t, _LANES)
    return _block(tp), _block(sp), tp, sp


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segments: jax.Array,
    kv_segments: jax.Array,
    *,
    offset: int = 0,
    window: int | None = None,
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA over segment-masked rows with splash attention: query t sees key s iff s <= t + offset,
    q_segments[t] == kv_segments[s] (and t + offset - s < window). Every query must see at least its own key
    (s = t + offset, same segment): then no softmax row is empty. Scores scale * q k^T (default Dh ** -0.5),
    soft-capped in the kernel with `softcap`; `sinks` [H] float32: each head's sink logit in its softmax's
    denominator (the kernel's own, with its gradient).

    q [B, T, H, Dh], k/v [B, S, K, Dh], q_segments [B, T], kv_segments [B, S] int32 -> [B, T, H, Dh] in q's dtype.
    Rows and heads are split over the context mesh (`shard_map`); on each shard the kernel runs per row (vmap).
    `interpret` None: interpreted unless compiling for a TPU.
    """
    interpret = target_platform() != "tpu" if interpret is None else interpret
    mesh = jax.sharding.get_abstract_mesh()
    run = functools.partial(_splash_local, offset=offset, window=window, interpret=interpret, scale=scale,
                            softcap=softcap)
    if mesh.empty:
        return run(q, k, v, q_segments, kv_segments, sinks)
    rows = _axis(fit_spec(("batch",), q.shape[:1], mesh), 0)
    heads = _axis(fit_spec((None, None, "heads"), q.shape[:3], mesh), 2)
    if heads != _axis(fit_spec((None, None, "kv"), k.shape[:3], mesh), 2):
        heads = None  # query head h reads kv head h // (H / K): split both alike or neither
    spec = jax.sharding.PartitionSpec(rows, None, heads, None)
    seg = jax.sharding.PartitionSpec(rows, None)
    if sinks is None:
        fn = jax.shard_map(run, mesh=mesh, in_specs=(spec, spec, spec, seg, seg), out_specs=spec, check_vma=False)
        return fn(q, k, v, q_segments, kv_segments)
    fn = jax.shard_map(run, mesh=mesh, in_specs=(spec, spec, spec, seg, seg, jax.sharding.PartitionSpec(heads)),
                       out_specs=spec, check_vma=False)
    return fn(q, k, v, q_segments, kv_segments, sinks)


def _axis(spec: jax.sharding.PartitionSpec, i: int) -> str | tuple[str, ...] | None:
    """Entry i of a spec (`fit_spec` drops trailing Nones)."""
    return spec[i] if len(spec) > i else None


def _splash_local(
    q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, sinks: jax.Array | None = None,
    *, offset: int, window: int | None, interpret: bool, scale: float | None = None, softcap: float | None = None,
) -> jax.Array:
    """`splash_attention` on one device's shard (no mesh)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, h, dh = q.shape
    s = k.shape[1]
    bq, bkv, tp, sp = splash_layout(t, s)
    # splash scales nothing: q * scale (default 1 / sqrt(Dh)), rounded once to the compute dtype; the kernel
    # soft-caps the scores of the scaled q, cap * tanh(q k^T / cap), as HF caps scale * q k^T
    qs = (q.astype(jnp.float32) * (dh**-0.5 if scale is None else scale)).astype(q.dtype)
    qs = jnp.pad(qs, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, H, Tp, Dh]
    kv_pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    kp = jnp.pad(k, kv_pad).transpose(0, 2, 1, 3)  # [B, K, Sp, Dh]
    vp = jnp.pad(v, kv_pad).transpose(0, 2, 1, 3)
    # padded queries and keys (segment -1) meet only each other: a padded query sees its own padded key
    q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
    kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, sp - s)), constant_values=-1)
    if window is None:
        mask = sm.CausalMask((tp, sp), offset=offset)
    else:
        mask = sm.LocalMask((tp, sp), window_size=(window - 1, 0), offset=offset)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)

    def run(q: jax.Array, k: jax.Array, v: jax.Array, qs: jax.Array, ks: jax.Array, *sink: jax.Array) -> jax.Array:
        # built where it runs: the kernel holds its mask's block tables as arrays of the trace that makes it
        kernel = sk.make_splash_mha(sm.MultiHeadMask([mask] * h), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret, attn_logits_soft_cap=softcap)
        call = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sk.SegmentIds(q=qs, kv=ks),  # noqa: E731
                                              sinks=sink[0] if sink else None)
        return jax.vmap(call)(q, k, v, qs, ks)

    # the compiler counts no FLOPs inside a Pallas kernel: the forward kernel's, by the blocks it visits, travel
    # in the name scope to `rloo_jax.hlo` (which scales them for the backward kernels)
    flops = attention_kernel_flops(b, h, dh, block_sparse_pairs(tp, sp, bq, bkv, offset, window))
    call = _at_precision(run, "highest" if q.dtype == jnp.float32 else "default")
    with jax.named_scope(kernel_flops_scope(flops)):
        o = call(qs, kp, vp, q_seg, kv_seg, *(() if sinks is None else (sinks.astype(jnp.float32),)))
    return o.transpose(0, 2, 1, 3)[:, :t]


def _at_precision(fn: Callable[..., jax.Array], precision: str) -> Callable[..., jax.Array]:
    """`fn` with its forward and backward traced at a fixed default matmul precision: the Pallas kernels' dots take
    the process-wide one (`rloo_jax.numerics`), and Mosaic compiles no bf16 dot at `highest` (a bf16 run whose
    float32 matmuls are asked for at `highest` would not compile). bf16 kernels run at `default` (their products
    are exact in the float32 accumulator); float32 kernels at `highest`, float32 whatever the run's setting."""

    @jax.custom_vjp
    def call(*args: jax.Array) -> jax.Array:
        with jax.default_matmul_precision(precision):
            return fn(*args)

    def forward(*args: jax.Array) -> tuple[jax.Array, Any]:
        with jax.default_matmul_precision(precision):
            return jax.vjp(fn, *args)

    def backward(pullback: Any, g: jax.Array) -> Any:
        with jax.default_matmul_precision(precision):
            return pullback(g)

    call.defvjp(forward, backward)
    return call


# ----------------------------------------------------------------------------------------------- cuDNN (GPU)
def front_shift(mask: jax.Array) -> jax.Array:
    """Index of each row's first real token (0 for a row without any): mask [B, T] -> int32 [B].

    Example: [[0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]] -> [2, 0, 0].
    """
    return jnp.argmax(mask > 0, axis=1).astype(jnp.int32)


def rotate_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row b rotated left by shift[b] along axis 1: out[b, t] = x[b, (t + shift[b]) % T]. x [B, T, ...]."""
    t = x.shape[1]
    idx = (jnp.arange(t)[None, :] + shift[:, None]) % t
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 2)), axis=1)


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, window: int | None = None,
    implementation: str = "cudnn", scale: float | None = None,
) -> jax.Array:
    """Causal GQA over rows whose real tokens are one contiguous run (left and/or right padding) with
    `jax.nn.dot_product_attention`: each row rotated so its real tokens come first, causal (within the window),
    rotated back. A real query then sees exactly the real tokens before it; a padding query sees the tokens before
    it (never an empty row). q [B, T, H, Dh], k/v [B, T, K, Dh], mask [B, T] -> [B, T, H, Dh].

    `implementation` "xla" runs the same call through XLA (materialised scores: tests off a GPU). `scale`: on
    q k^T (default Dh ** -0.5); no soft-capping (`effective` sends soft-capped models to eager).
    """
    shift = front_shift(mask)
    o = jax.nn.dot_product_attention(
        rotate_rows(q, shift), rotate_rows(k, shift), rotate_rows(v, shift), is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation, scale=scale,
    )
    return rotate_rows(o, -shift)


def _cudnn_call(platform: str) -> str:
    return "cudnn" if platform == "gpu" else "xla"


# ----------------------------------------------------------------------------------------------- the two forms
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
SharedFn = Callable[..., tuple[jax.Array, jax.Array]]


def causal(
    mask: jax.Array, positions: jax.Array, *, implementation: str | None, window: int | None, dtype: jnp.dtype,
    scale: float | None = None, softcap: float | None = None, sinks: bool = False,
) -> AttendFn:
    """Causal self-attention over B padded rows (real tokens: `mask` [B, T]; their positions [B, T]), built once
    per forward: -> fn(q [B, T, H, Dh], k, v [B, T, K, Dh]) -> [B, T, H, Dh]. Exact for any padding with eager and
    splash; cudnn needs each row's real tokens contiguous (as left- or right-padded rows are). `sinks`: the model
    has attention sinks, passed per layer as fn(q, k, v, sinks [H]) (eager only: `_resolved`)."""
    impl = _resolved(implementation, dtype, softcap, sinks)
    if impl == "eager":
        allowed = causal_allowed(mask, positions, window)
        return lambda q, k, v, sinks=None: attend(q, k, v, allowed, scale=scale, softcap=softcap, sinks=sinks)
    if impl == "splash":
        seg = (mask > 0).astype(jnp.int32)
        return lambda q, k, v, sinks=None: splash_attention(q, k, v, seg, seg, window=window, scale=scale,
                                                            softcap=softcap, sinks=sinks)
    call = _cudnn_call(target_platform())
    return lambda q, k, v: cudnn_attention(q, k, v, mask, window=window, implementation=call, scale=scale)


def shared_prompt(
    prompt_mask: jax.Array,
    prompt_positions: jax.Array,
    completion_mask: jax.Array,
    completion_positions: jax.Array,
    *,
    implementation: str | None,
    window: int | None,
    dtype: jnp.dtype,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> SharedFn:
    """B left-padded prompts, each continued by G right-padded completions (row n continues prompt n // G; its
    mask a prefix of ones), built once per forward: prompt_mask, prompt_positions [B, P]; completion_mask,
    completion_positions [N, C] (positions continue each prompt's) ->
    fn(qp [B, P, H, Dh], qc [N, C, H, Dh], pk, pv [B, P, K, Dh], gk, gv [N, C, K, Dh]) -> (prompt out [B, P, H, Dh],
    completion out [N, C, H, Dh]): the prompts' causal self-attention and each completion token's one softmax over
    its prompt's real tokens and its own real tokens up to itself (within the window). `sinks`: as `causal`'s
    (fn(..., sinks [H]))."""
    impl = _resolved(implementation, dtype, softcap, sinks)
    opts = {"scale": scale, "softcap": softcap}
    b, p = prompt_mask.shape
    n, c = completion_mask.shape
    g = n // b
    if impl == "eager":
        pp_allowed = causal_allowed(prompt_mask, prompt_positions, window)  # [B, P, P]
        cq = completion_positions.reshape(b, g, c)
        cp_allowed = (prompt_mask[:, None, None, :] > 0) & visible(cq[..., None], prompt_positions[:, None, None, :],
                                                                   window)  # [B, G, C, P]
        jdx = jnp.arange(c)
        cc_allowed = (jdx[:, None] >= jdx[None, :])[None] & (completion_mask[:, None, :] > 0)
        cc_allowed = cc_allowed.reshape(b, g, c, c) & visible(cq[..., None], cq[:, :, None, :], window)

        def eager(qp, qc, pk, pv, gk, gv, sinks=None):  # noqa: ANN001, ANN202
            o_prompt = attend(qp, pk, pv, pp_allowed, sinks=sinks, **opts)
            o_comp = attend_shared_prompt(qc.reshape(b, g, c, *qc.shape[2:]), pk.swapaxes(1, 2), pv.swapaxes(1, 2),
                                          cp_allowed, gk.swapaxes(1, 2), gv.swapaxes(1, 2), cc_allowed, sinks=sinks,
                                          **opts)
            return o_prompt, o_comp.reshape(qc.shape)

        return eager
    pseg = (prompt_mask > 0).astype(jnp.int32)
    cseg = (completion_mask > 0).astype(jnp.int32)
    if impl == "splash":
        # per completion row: keys [its prompt's (left-padded, so index distance = position distance); its own],
        # queries its C tokens at key index P + t: causal with the offset P; padding by segment ids
        kv_seg = jnp.concatenate([jnp.repeat(pseg, g, axis=0), cseg], axis=1)  # [N, P + C]

        def splash(qp, qc, pk, pv, gk, gv, sinks=None):  # noqa: ANN001, ANN202
            o_prompt = splash_attention(qp, pk, pv, pseg, pseg, window=window, sinks=sinks, **opts)
            keys = jnp.concatenate([jnp.repeat(pk, g, axis=0), gk], axis=1)
            values = jnp.concatenate([jnp.repeat(pv, g, axis=0), gv], axis=1)
            return o_prompt, splash_attention(qc, keys, values, cseg, kv_seg, offset=p, window=window, sinks=sinks,
                                              **opts)

        return splash
    # cudnn: per completion row the whole [prompt; completion] row (one contiguous run of real tokens), causal;
    # the prompt queries run G times (the prompt's output is read from each group's first row): P / (P + C) more
    # attention work, where a boolean mask would have been a materialised [N, P + C, C] bias
    row_mask = jnp.concatenate([jnp.repeat(prompt_mask, g, axis=0), completion_mask], axis=1)
    call = _cudnn_call(target_platform())

    def cudnn(qp, qc, pk, pv, gk, gv):  # noqa: ANN001, ANN202
        rows = [jnp.concatenate([jnp.repeat(xp, g, axis=0), xc], axis=1) for xp, xc in ((qp, qc), (pk, gk), (pv, gv))]
        o = cudnn_attention(*rows, row_mask, window=window, implementation=call, scale=scale)
        return o[::g, :p], o[:, p:]

    return cudnn
