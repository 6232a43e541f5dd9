"""Sampling: prefill each prompt once, decode its G samples with a shared KV cache in a ``lax.while_loop``.

Shape letters: B prompts, G samples per prompt, N = B*G rows (prompt-major: ``[p0]*G + [p1]*G + ...``),
P prompt length, C = ``max_new_tokens`` (fixed), V vocabulary.

The token choice is a chain of small pure filters on ``[N, V]`` logits, in Hugging Face's order:
repetition penalty -> temperature -> top-k -> top-p -> min-p, then one draw per row. The log-prob recorded
for the chosen token is TRL's training quantity, ``log_softmax(logits / T)`` over the FULL vocabulary of the
raw model logits: the filters and the penalty change what is sampled, never the log-prob (``T = 0``, greedy,
records it at ``T = 1``).

Two entry points:

- ``generate_fn(graphdef, params, prompt_ids, prompt_mask, key, cfg)``: pure and jittable, for a caller's jit.
- ``generate(model, prompt_ids, prompt_mask, *, key, ...)``: the eager path; pads the prompt length to a
  bucket and calls a module-level ``jax.jit`` of ``generate_fn`` (one compile per bucket:
  ``compile_count``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from rloo_jax.mesh import BATCH_AXES, LOGICAL_RULES, constrain

__all__ = [
    "Generation",
    "SamplingConfig",
    "apply_repetition_penalty",
    "bucket_prompts",
    "choose_tokens",
    "compile_count",
    "generate",
    "generate_fn",
    "greedy_tokens",
    "inverse_cdf_sample",
    "min_p_filter",
    "rollout_weights",
    "row_uniforms",
    "step_uniforms",
    "token_logps",
    "top_k_filter",
    "top_p_filter",
]


DECODE_LOOP = "decode_loop"
"""The name scope of the sampler's token-by-token loop: compiled programs carry it in the loop's `op_name`."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Every static sampling option: hashable, so it can be a static argument of ``jax.jit``."""

    max_new_tokens: int
    """C: completion length; every completion has exactly C slots (right-padded with ``pad_token_id``)."""
    num_generations: int = 1
    """G: samples per prompt; they share the prompt's KV cache."""
    temperature: float = 1.0
    """Softmax temperature for sampling and for the recorded log-probs; 0 means greedy (log-probs at T=1)."""
    top_k: int = 0
    """Keep the k largest logits (ties kept); 0 disables."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose probability sums to >= top_p; 1 disables."""
    min_p: float = 0.0
    """Keep tokens whose probability is >= min_p * (the largest probability); 0 disables."""
    repetition_penalty: float = 1.0
    """HF/CTRL penalty on tokens already in the prompt or completion: logit > 0 -> /p, else *p; 1 disables."""
    eos_token_ids: tuple[int, ...] = ()
    """Every id here ends a row (the EOS is kept and counts in the mask)."""
    pad_token_id: int = 0
    """Emitted after a row has finished; its mask and log-prob are 0."""

    def __post_init__(self) -> None:
        # None (TRL's "unset") means the filter is off.
        for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, off)
        eos = self.eos_token_ids
        eos = (eos,) if isinstance(eos, int | np.integer) else eos
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in eos))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@struct.dataclass
class Generation:
    """Completions of one ``generate`` call; rows prompt-major (``[p0]*G + [p1]*G + ...``)."""

    completion_ids: jax.Array  # [N, C] int32, right-padded with pad_token_id
    completion_mask: jax.Array  # [N, C] int32, 1 up to and including the first EOS
    is_truncated: jax.Array  # [N] bool, no EOS within C tokens
    lengths: jax.Array  # [N] int32, completion_mask.sum(-1)
    logps: jax.Array  # [N, C] float32, log_softmax(logits / T)[token], 0 outside the mask
    # a mixture of experts: each token's experts per layer as the sampler routed it (`transformer.Routes`: the
    # prompts left-aligned, every completion token but the last), for routing replay; None for a dense model
    routes: Any = None


# ----------------------------------------------------------------------------------------------- filters


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """HF ``RepetitionPenaltyLogitsProcessor``: on seen tokens, ``l < 0 -> l * p``, else ``l / p``.

    logits [N, V] f32, seen [N, V] bool (token already in the prompt or the completion) -> [N, V].
    E.g. p=2: logits [2., -1., 3.], seen [T, T, F] -> [1., -2., 3.].
    """
    penalized = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalized, logits)


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """HF ``TopKLogitsWarper``: logits below the k-th largest become -inf (ties with it are kept).

    logits [N, V] -> [N, V]; k >= V keeps everything. E.g. k=2: [1., 3., 2., 3.] -> [-inf, 3., -inf, 3.].
    """
    k = min(k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """HF ``TopPLogitsWarper``: keep the fewest most likely tokens whose probabilities sum to >= top_p.

    With p_(1) >= p_(2) >= ... the softmax probabilities sorted in descending order, token (i) is kept iff
    the mass strictly before it, ``sum_{j<i} p_(j)``, is < top_p (so the top token is always kept); every
    token whose probability equals the smallest kept one is kept too. logits [N, V] -> [N, V], -inf where
    removed.
    E.g. probs [.5, .3, .2], top_p=.7 -> keeps the .5 and .3 tokens.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    desc = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(desc, axis=-1) - desc
    num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(desc, num_kept - 1, axis=-1)
    return jnp.where(probs < cutoff, -jnp.inf, logits)


def min_p_filter(logits: jax.Array, min_p: float) -> jax.Array:
    """HF ``MinPLogitsWarper``: tokens with probability < min_p * max probability become -inf.

    ``p_i / p_max = exp(l_i - l_max)``, so no softmax is needed. logits [N, V] -> [N, V]; the top token is
    always kept. E.g. min_p=.5: probs [.6, .35, .05] -> keeps the .6 and .35 tokens.
    """
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(jnp.exp(logits - top) < min_p, -jnp.inf, logits)


# ----------------------------------------------------------------------------------------------- choice


def greedy_tokens(scores: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties: ``min{i : s_i = max(s)}``.

    scores [N, V] -> [N] int32. A max then a min-index reduction: the same result as ``jnp.argmax`` but
    several times faster on XLA:CPU (see BENCHMARKS.md).
    """
    vocab = scores.shape[-1]
    top = jnp.max(scores, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return jnp.min(jnp.where(scores == top, iota, vocab), axis=-1)


def inverse_cdf_sample(scores: jax.Array, uniforms: jax.Array, block: int = 256) -> jax.Array:
    """Draw one token per row from ``softmax(scores)`` by inverting its CDF with one uniform per row.

    ``w = exp(s - max s)``, ``x = u * sum(w)``, token = the first i with ``cumsum(w)_i >= x``.
    scores [N, V] (-inf = excluded), uniforms [N] in (0, 1) -> [N] int32.
    E.g. scores log[.2, .5, .3], u=.6 -> cdf [.2, .7, 1.] -> token 1.

    Two levels, so no scan runs over all V (a V-long cumsum is slow on XLA:CPU): the cumsum of the V/block
    block sums picks the block, then a cumsum inside that one block picks the token. A token with weight 0
    never satisfies ``cdf_{i-1} < x <= cdf_i``, and ``x`` is clipped into ``(0, block total]``, so
    filtered tokens are never drawn.
    """
    rows, vocab = scores.shape
    num_blocks = -(-vocab // block)
    w = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, num_blocks * block - vocab))).reshape(rows, num_blocks, block)
    block_sums = w.sum(axis=-1)  # [N, nb]
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    x = uniforms * block_cdf[:, -1]
    chosen = jnp.minimum(jnp.sum(block_cdf < x[:, None], axis=-1, dtype=jnp.int32), num_blocks - 1)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(w, chosen[:, None, None], axis=1)[:, 0], axis=-1)  # [N, block]
    before = jnp.take_along_axis(block_cdf - block_sums, chosen[:, None], axis=1)[:, 0]
    x_inner = jnp.clip(x - before, jnp.finfo(jnp.float32).tiny, inner_cdf[:, -1])
    return chosen * block + jnp.sum(inner_cdf < x_inner[:, None], axis=-1, dtype=jnp.int32)


def token_logps(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """``log_softmax(logits / T)[token]`` over the full vocabulary (TRL's per-token log-prob).

    logits [N, V] f32, tokens [N] int -> [N] f32. E.g. logits [0, log 3], T=1, token 1 -> log .75.
    """
    z = logits if temperature == 1.0 else logits / temperature
    picked = jnp.take_along_axis(z, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def row_uniforms(key: jax.Array, step: jax.Array | int, num_rows: int) -> jax.Array:
    """One uniform in (0, 1) per row from ``fold_in(fold_in(key, step), row)``: [N] float32.

    A row's draw depends only on (key, step, row index), never on the other rows; different steps and rows
    never share randomness. The lower bound is the smallest normal float, so ``inverse_cdf_sample`` never
    sees 0.
    """
    step_key = jax.random.fold_in(key, step)
    row_ids = jnp.arange(num_rows, dtype=jnp.uint32)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, row_ids)
    tiny = jnp.finfo(jnp.float32).tiny
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, minval=tiny, maxval=1.0))(row_keys)


def _has_filters(cfg: SamplingConfig) -> bool:
    return cfg.top_k > 0 or cfg.top_p < 1.0 or cfg.min_p > 0.0 or cfg.repetition_penalty != 1.0


def step_uniforms(key: jax.Array, num_steps: int, num_rows: int) -> jax.Array:
    """``row_uniforms(key, s, N)`` for every step s < num_steps at once: [num_steps, N] float32, the same values.

    The sampler draws them all before its decode loop: one batched threefry instead of three small ones (each a
    rolled loop of tiny kernels on XLA:CPU) inside every decode step.
    """
    return jax.vmap(lambda s: row_uniforms(key, s, num_rows))(jnp.arange(num_steps, dtype=jnp.int32))


def choose_tokens(
    logits: jax.Array,
    seen: jax.Array | None,
    key: jax.Array,
    step: jax.Array | int,
    cfg: SamplingConfig,
    uniforms: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row and its log-prob: logits [N, V] f32 -> (tokens [N] int32, logps [N] f32).

    Greedy (T = 0): penalty then ``greedy_tokens``; logps at T = 1. Sampling: penalty -> /T -> top-k ->
    top-p -> min-p -> ``inverse_cdf_sample`` with ``row_uniforms(key, step, N)`` (or ``uniforms`` [N] when given,
    e.g. a row of ``step_uniforms``); logps = ``token_logps(logits, tok, T)`` of the raw logits. ``seen`` [N, V]
    bool is only read when ``cfg.repetition_penalty != 1``.
    """
    scores = logits
    if cfg.repetition_penalty != 1.0:
        scores = apply_repetition_penalty(scores, seen, cfg.repetition_penalty)
    if cfg.greedy:
        tokens = greedy_tokens(scores)
        return tokens, token_logps(logits, tokens, 1.0)
    scores = scores if cfg.temperature == 1.0 else scores / cfg.temperature
    if cfg.top_k > 0:
        scores = top_k_filter(scores, cfg.top_k)
    if cfg.top_p < 1.0:
        scores = top_p_filter(scores, cfg.top_p)
    if cfg.min_p > 0.0:
        scores = min_p_filter(scores, cfg.min_p)
    tokens = inverse_cdf_sample(scores, row_uniforms(key, step, logits.shape[0]) if uniforms is None else uniforms)
    return tokens, token_logps(logits, tokens, cfg.temperature)


# ----------------------------------------------------------------------------------------------- decode loop


@struct.dataclass
class _LoopState:
    step: jax.Array  # [] int32, the completion slot written next
    last: jax.Array  # [N] int32, token written at step - 1 (the next decode input)
    done: jax.Array  # [N] bool, an EOS has been written
    ids: jax.Array  # [N, C] int32
    logps: jax.Array  # [N, C] float32
    seen: jax.Array | None  # [N, V] bool, only with a repetition penalty
    cache: object  # the model's DecodeCache


def _left_align(prompt_ids: jax.Array, prompt_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Move each row's real tokens to the right end, keeping their order (any padding -> left padding)."""
    order = jnp.argsort(prompt_mask.astype(jnp.int32), axis=1, stable=True)
    return jnp.take_along_axis(prompt_ids, order, axis=1), jnp.take_along_axis(prompt_mask, order, axis=1)


def _is_eos(tokens: jax.Array, eos_token_ids: tuple[int, ...]) -> jax.Array:
    if not eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_token_ids, tokens.dtype))


def _completion_mask(ids: jax.Array, eos_token_ids: tuple[int, ...]) -> jax.Array:
    """1 up to and including the first EOS of each row: [N, C] int32."""
    eos = _is_eos(ids, eos_token_ids).astype(jnp.int32)
    return (jnp.cumsum(eos, axis=1) - eos == 0).astype(jnp.int32)


def compute_dtype_weights(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
    """Matmul weights (``kernel``, ``embedding``, LoRA's ``lora_a``/``lora_b``, the fused modules' shared A,
    ``qkv_lora_a``/``gate_up_lora_a``, a mixture of experts' router and experts and their adapters) cast to the
    model's compute dtype once, e.g. f32 -> bf16. (The experts were left in f32 before: a Qwen3-30B-A3B decode step
    then read 3.3x its floor, every step converting every expert again.)

    The layers cast them on every use anyway (same values); casting before the decode loop means each step reads
    half the weight bytes instead of converting every weight again. Norm scales keep their dtype (the norms
    compute in f32 from them). A no-op when the compute and parameter dtypes agree.
    """
    dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)

    def cast(path: tuple, x: jax.Array) -> jax.Array:
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        weight = bool(names & {"kernel", "embedding", "lora_a", "lora_b", "qkv_lora_a", "gate_up_lora_a", "router",
                               "experts_gate", "experts_up", "experts_down", "experts_gate_up_lora_a",
                               "experts_gate_lora_b", "experts_up_lora_b", "experts_down_lora_a",
                               "experts_down_lora_b"})
        return x.astype(dtype) if weight and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree_util.tree_map_with_path(cast, params)


def rollout_weights(
    graphdef: nnx.GraphDef, params: nnx.State, source: jax.sharding.AbstractMesh | None = None
) -> nnx.State:
    """What the sampler decodes with: the matrices in the compute dtype (``compute_dtype_weights``), every parameter
    laid out by the rule table on the mesh the function is traced on (``rloo_jax.mesh.constrain``). Traced on the
    sampler's own mesh (``generate_fn``'s ``mesh``), this is where the weights move from the training layout into
    the sampler's, once per call: e.g. from FSDP shards to tensor-parallel ones, so that the decode loop that
    follows reads its weights from HBM instead of gathering every layer over ICI at every step. A no-op layout
    without a mesh, and on the training mesh itself.

    ``source``: the mesh the weights arrive on. Where it is FSDP over all its devices (the default training mesh),
    ``embed`` is first split over the sampler's data axes (from FSDP over every device: an all-to-all within each
    group of tensor-parallel devices), then gathered (an all-gather over the data axes): for the direct move,
    XLA's partitioner gathers whole matrices on every device and slices them (BENCHMARKS.md).

    On a mesh with fsdp > 1 the LM head (or the tied embedding) is laid out split along V over fsdp and along D over
    tensor (the rule table's ``decode_vocab`` / ``decode_embed``, named in its metadata for ``CausalLM.unembed``),
    where fsdp divides V: a decode step's rows then go to the head and return as their logits' columns, instead of
    every chip writing and all-reducing float32 partial logits of every row (BENCHMARKS.md, Session 23)."""
    via_fsdp = source is not None and not source.empty and source.shape["data"] * source.shape["tensor"] == 1
    mesh = jax.sharding.get_abstract_mesh()
    fsdp = 1 if mesh.empty else mesh.shape.get("fsdp", 1)
    tied = nnx.merge(graphdef, params).lm_head is None
    head = ("model", "embed", "embedding") if tied else ("lm_head", "kernel")
    decode_head = ("decode_vocab", "decode_embed") if tied else ("decode_embed", "decode_vocab")

    def one(path: tuple, v: nnx.Variable) -> nnx.Variable:
        logical = tuple(v.get_metadata().get("out_sharding") or (None,) * v[...].ndim)
        x = constrain(v[...], logical, {**LOGICAL_RULES, "embed": BATCH_AXES}) if via_fsdp else v[...]
        names = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        if names[-len(head):] == head and fsdp > 1 and x.shape[0 if tied else 1] % fsdp == 0:
            # V-split once here (an all-to-all), for the decode's rows to visit
            return v.replace(constrain(x, decode_head), out_sharding=decode_head)
        return v.replace(constrain(x, logical))

    params = compute_dtype_weights(graphdef, params)
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _traced_on(mesh: Mesh | jax.sharding.AbstractMesh | None) -> contextlib.AbstractContextManager:
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh)


def _rows(x: jax.Array) -> jax.Array:
    """``x [rows, ...]`` laid out by rows on the mesh traced on (a no-op without one)."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def generate_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    cfg: SamplingConfig,
    mesh: Mesh | None = None,
) -> Generation:
    """Sample ``cfg.num_generations`` completions of ``cfg.max_new_tokens`` slots per prompt; jittable.

    prompt_ids, prompt_mask [B, P] (any padding; moved to the left here) -> ``Generation`` with N = B*G rows.
    The B prompts are prefilled once; ``init_decode_cache`` shares each prompt's KV with its G rows. Token
    s of every row is chosen from the logits after token s-1, in a ``lax.while_loop`` that stops once every
    row has emitted an EOS (finished rows emit pad). ``graphdef`` and ``cfg`` must be static under an outer
    jit.

    ``mesh``: the sampler's own layout (``rloo_jax.mesh.reshaped``, e.g. tensor-parallel where training is FSDP):
    the weights move into it once (``rollout_weights``) and everything is traced on it, so the model's activation
    and KV-cache constraints follow its axes. Inputs and outputs may live on another mesh of the same devices
    (the caller's jit shardings). None: the mesh the caller traces on, if any.
    """
    caller = jax.sharding.get_abstract_mesh()
    with _traced_on(mesh):  # every input enters the sampler's mesh: the weights by the rule table, rows by rows
        inputs = _rows(prompt_ids), _rows(prompt_mask), constrain(key, ())
        gen = _generate(graphdef, rollout_weights(graphdef, params, caller), *inputs, cfg)
    with _traced_on(caller):  # and the completions return to the caller's
        return jax.tree.map(_rows, gen)


def _generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    cfg: SamplingConfig,
) -> Generation:
    model = nnx.merge(graphdef, params)
    prompt_ids, prompt_mask = _left_align(prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32))
    num_prompts = prompt_ids.shape[0]
    group, length, pad = cfg.num_generations, cfg.max_new_tokens, cfg.pad_token_id
    rows = num_prompts * group

    last_logits, prompt_cache = model.prefill(prompt_ids, prompt_mask, length)  # length: LongRoPE's choice
    cache = model.init_decode_cache(prompt_cache, group, length)
    logits = jnp.repeat(last_logits, group, axis=0)  # [N, V]
    vocab = logits.shape[-1]

    seen = None
    if cfg.repetition_penalty != 1.0:
        # Real prompt tokens only: HF also penalizes the left-pad id, which differs between rows of one batch.
        prompt_seen = jnp.zeros((num_prompts, vocab), bool)
        prompt_seen = prompt_seen.at[jnp.arange(num_prompts)[:, None], prompt_ids].max(prompt_mask > 0)
        seen = jnp.repeat(prompt_seen, group, axis=0)

    draws = None if cfg.greedy else step_uniforms(key, length, rows)  # [C, N]

    def emit(state: _LoopState, logits: jax.Array) -> _LoopState:
        u = None if draws is None else jax.lax.dynamic_index_in_dim(draws, state.step, keepdims=False)
        tokens, logps = choose_tokens(logits, state.seen, key, state.step, cfg, u)
        tokens = jnp.where(state.done, pad, tokens)
        logps = jnp.where(state.done, 0.0, logps)
        new_seen = state.seen
        if new_seen is not None:
            new_seen = new_seen.at[jnp.arange(rows), tokens].set(True)
        return state.replace(
            step=state.step + 1,
            last=tokens,
            done=state.done | _is_eos(tokens, cfg.eos_token_ids),
            ids=jax.lax.dynamic_update_slice_in_dim(state.ids, tokens[:, None], state.step, axis=1),
            logps=jax.lax.dynamic_update_slice_in_dim(state.logps, logps[:, None], state.step, axis=1),
            seen=new_seen,
        )

    def cond(state: _LoopState) -> jax.Array:
        return (state.step < length) & ~jnp.all(state.done)

    def body(state: _LoopState) -> _LoopState:
        logits, cache = model.decode_step(state.last, state.step - 1, state.cache)
        return emit(state.replace(cache=cache), logits)

    state = _LoopState(
        step=jnp.zeros((), jnp.int32),
        last=jnp.full((rows,), pad, jnp.int32),
        done=jnp.zeros((rows,), bool),
        ids=jnp.full((rows, length), pad, jnp.int32),
        logps=jnp.zeros((rows, length), jnp.float32),
        seen=seen,
        cache=cache,
    )
    # The first token comes from the prefill logits, so the loop never runs a forward whose logits go unused.
    state = emit(state, logits)
    with jax.named_scope(DECODE_LOOP):  # how `rloo_jax.hlo.named_loop` finds this loop in the compiled program
        state = jax.lax.while_loop(cond, body, state)

    mask = _completion_mask(state.ids, cfg.eos_token_ids)
    lengths = mask.sum(axis=1, dtype=jnp.int32)
    ended = jnp.any(_is_eos(state.ids, cfg.eos_token_ids) & (mask > 0), axis=1)
    return Generation(
        completion_ids=state.ids,
        completion_mask=mask,
        is_truncated=~ended,
        lengths=lengths,
        logps=jnp.where(mask > 0, state.logps, 0.0),
        routes=model.recorded_routes(state.cache),
    )


# ----------------------------------------------------------------------------------------------- eager path

_TRACES = 0


def compile_count() -> int:
    """How many times ``generate``'s jitted function has been traced (= compiled) in this process."""
    return _TRACES


def _generate_traced(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    cfg: SamplingConfig,
) -> Generation:
    global _TRACES
    _TRACES += 1  # runs at trace time only
    return generate_fn(graphdef, params, prompt_ids, prompt_mask, key, cfg)


_generate_jit = jax.jit(_generate_traced, static_argnames=("graphdef", "cfg"))


def bucket_prompts(
    prompt_ids: np.ndarray, prompt_mask: np.ndarray, bucket: int, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Left-align the prompts, drop all-pad columns, left-pad P to a multiple of ``bucket`` (host, numpy).

    [B, P] -> [B, P'] with ``P' = bucket * ceil(max_b real_b / bucket)``; so any batch whose longest prompt
    falls in the same bucket has the same shape (one compile). E.g. bucket 4, real lengths [3, 5] -> P' = 8.
    """
    ids = np.asarray(prompt_ids)
    mask = np.asarray(prompt_mask).astype(np.int32)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must be the same [B, P] shape")
    real = mask.sum(axis=1)
    if real.min(initial=1) < 1:
        raise ValueError("every prompt needs at least one real (mask = 1) token")
    width = max(bucket, -(-int(real.max(initial=1)) // bucket) * bucket)
    out_ids = np.full((ids.shape[0], width), pad_token_id, np.int32)
    out_mask = np.zeros((ids.shape[0], width), np.int32)
    for b in range(ids.shape[0]):
        tokens = ids[b][mask[b] > 0]
        out_ids[b, width - len(tokens) :] = tokens
        out_mask[b, width - len(tokens) :] = 1
    return out_ids, out_mask


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array | np.ndarray,
    prompt_mask: jax.Array | np.ndarray,
    *,
    key: jax.Array,
    max_new_tokens: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_token_ids: int | Sequence[int] = (),
    pad_token_id: int = 0,
    prompt_bucket: int = 16,
) -> Generation:
    """Sample completions from ``model`` (a ``CausalLM``); see ``SamplingConfig`` for the options.

    prompt_ids, prompt_mask [B, P] -> ``Generation`` with ``B * num_generations`` rows of ``max_new_tokens``
    slots, prompt-major. The prompt length is bucketed (``bucket_prompts``) so a run compiles once per bucket;
    the same key gives the same completions.
    """
    cfg = SamplingConfig(
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
    )
    if prompt_bucket < 1:
        raise ValueError(f"prompt_bucket must be >= 1, got {prompt_bucket}")
    ids, mask = bucket_prompts(prompt_ids, prompt_mask, prompt_bucket, pad_token_id)
    graphdef, params = nnx.split(model)
    return _generate_jit(graphdef, params, ids, mask, key, cfg)


def sampling_config(cfg: Any, eos_token_ids: tuple[int, ...], pad_token_id: int, num_generations: int
                    ) -> SamplingConfig:
    """The sampler's options from the run config (`cfg`: its generation options), the ids that end a completion and
    the pad id, for `num_generations` completions per prompt (training's, or evaluation's)."""
    return SamplingConfig(
        max_new_tokens=cfg.max_completion_length,
        num_generations=num_generations,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        eos_token_ids=tuple(eos_token_ids),
        pad_token_id=int(pad_token_id),
    )
