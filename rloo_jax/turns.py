"""The multi-turn sampler: every row decodes until it emits an EOS (the end of an assistant turn), the host reads
the turn (tool calls, `rloo_jax.tools`), and the rows it continues get the new tokens (the tool results and the next
turn's header) appended to their OWN KV cache (a prefill of those tokens only) and decode on.

Shape letters: B prompts, G samples per prompt, N = B*G rows, P prompt length, C = ``max_new_tokens`` completion
slots (every token after the prompt: the model's and the tool results'), T new tokens per resumed row (bucketed),
V vocabulary.

A row is RUNNING (decoding), PAUSED (it emitted an EOS: the host decides) or DONE. Each row has its own cursor (the
completion slots filled), so rows stand at different lengths and in different turns at once. Two programs:

- ``start_turns``: prefill each prompt once (shared by its G rows), decode every row until ``pause_at`` rows are
  paused or none runs.
- ``resume_turns``: rows the host finishes become DONE; rows given new tokens get them written after their last
  token and prefilled (``Transformer.extend``: T + 1 tokens, the +1 the row's last sampled token, whose key/value a
  decode step would otherwise write), then sample their next token; then decode as above.

Fixed shapes: ``resume_turns`` compiles once per bucket T (``suffix_buckets``), whatever the number of turns.
Draws are per (row, completion slot) (``sampling.step_uniforms``), so a row's tokens never depend on when the host
resumed it, and a rollout without tool calls samples what ``sampling.generate_fn`` samples.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from rloo_jax.sampling import (
    DECODE_LOOP,
    SamplingConfig,
    _is_eos,
    _left_align,
    _rows,
    _traced_on,
    choose_tokens,
    constrain,
    rollout_weights,
    step_uniforms,
)

RUNNING, PAUSED, DONE = 0, 1, 2
"""A row's status (``Turns.status``)."""


@struct.dataclass
class Turns:
    """A batch of multi-turn rollouts between two programs (rows prompt-major, row r continues prompt r // G)."""

    prompt_ids: jax.Array  # [B, P] int32, left-aligned
    prompt_mask: jax.Array  # [B, P] int32
    ids: jax.Array  # [N, C] int32: the completion so far (model and tool tokens), pad beyond the cursor
    logps: jax.Array  # [N, C] float32: the sampler's log-prob of each sampled token, 0 elsewhere
    sampled: jax.Array  # [N, C] int32: 1 where the model sampled the token (TRL's tool_mask over real tokens)
    cursor: jax.Array  # [N] int32: completion slots filled
    status: jax.Array  # [N] int32: RUNNING, PAUSED or DONE
    seen: jax.Array | None  # [N, V] bool: tokens in the prompt or the completion (repetition penalty only)
    cache: Any  # the model's DecodeCache: the shared prompt KV [L, B, ...] and each row's own [L, N, K, C, Dh]


def suffix_buckets(max_new_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """The widths T a resumed turn's new tokens are padded to: ``smallest * 2^k`` below ``max_new_tokens``, then
    ``max_new_tokens`` itself (no suffix is longer: the host drops one that would not fit). One ``resume_turns``
    program each. Example: (100, 16) -> (16, 32, 64, 100); (12, 16) -> (12,)."""
    widths, w = [], smallest
    while w < max_new_tokens:
        widths.append(w)
        w *= 2
    return (*widths, max_new_tokens)


def suffix_bucket(length: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``length`` new tokens. Example: 20 in (16, 32, 64) -> 32."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"{length} new tokens exceed the largest bucket {buckets[-1]}")


def _emit(t: Turns, logits: jax.Array, active: jax.Array, draws: jax.Array | None, key: jax.Array,
          cfg: SamplingConfig) -> Turns:
    """Each ``active`` row samples one token from ``logits [N, V]`` into its slot ``cursor``: RUNNING on, PAUSED on
    an EOS, DONE when its slots are full (a row with no slot left ends DONE without a token)."""
    n, c = t.ids.shape
    rows = jnp.arange(n)
    slot = jnp.minimum(t.cursor, c - 1)
    u = None if draws is None else draws[slot, rows]
    tokens, logps = choose_tokens(logits, t.seen, key, slot, cfg, u)
    write = active & (t.cursor < c)
    at = jnp.where(write, t.cursor, c)  # out of bounds: dropped
    ids = t.ids.at[rows, at].set(tokens, mode="drop")
    new_logps = t.logps.at[rows, at].set(logps, mode="drop")
    sampled = t.sampled.at[rows, at].set(1, mode="drop")
    cursor = t.cursor + write.astype(jnp.int32)
    eos = _is_eos(tokens, cfg.eos_token_ids)
    status = jnp.where(active & ~write, DONE, t.status)
    status = jnp.where(write & eos, PAUSED, jnp.where(write & (cursor >= c), DONE, status))
    seen = t.seen
    if seen is not None:
        seen = seen.at[rows, tokens].max(write)
    return t.replace(ids=ids, logps=new_logps, sampled=sampled, cursor=cursor, status=status, seen=seen)


def _last_tokens(t: Turns) -> jax.Array:
    """[N] each row's last completion token (its key/value not yet written; 0 for an empty row)."""
    return jnp.take_along_axis(t.ids, jnp.maximum(t.cursor - 1, 0)[:, None], axis=1)[:, 0]


def _decode(model: Any, t: Turns, draws: jax.Array | None, key: jax.Array, cfg: SamplingConfig,
            pause_at: int) -> Turns:
    """Decode the RUNNING rows, one token per step, until ``pause_at`` rows are PAUSED or none runs."""

    def cond(t: Turns) -> jax.Array:
        return jnp.any(t.status == RUNNING) & (jnp.sum(t.status == PAUSED) < pause_at)

    def body(t: Turns) -> Turns:
        running = t.status == RUNNING
        h, cache = model.model.extend(_last_tokens(t)[:, None], t.cursor - 1, running[:, None], t.cache)
        return _emit(t.replace(cache=cache), model.unembed(h[:, 0]), running, draws, key, cfg)

    with jax.named_scope(DECODE_LOOP):  # compile-only's report finds the loop by this name (`rloo_jax.hlo`)
        return jax.lax.while_loop(cond, body, t)


def _start(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
           key: jax.Array, cfg: SamplingConfig, pause_at: int) -> Turns:
    model = nnx.merge(graphdef, params)
    prompt_ids, prompt_mask = _left_align(prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32))
    b, g, c = prompt_ids.shape[0], cfg.num_generations, cfg.max_new_tokens
    n = b * g
    last_logits, prompt_cache = model.prefill(prompt_ids, prompt_mask, c)
    cache = model.init_decode_cache(prompt_cache, g, c)
    logits = jnp.repeat(last_logits, g, axis=0)  # [N, V]
    seen = None
    if cfg.repetition_penalty != 1.0:
        prompt_seen = jnp.zeros((b, logits.shape[-1]), bool)
        prompt_seen = prompt_seen.at[jnp.arange(b)[:, None], prompt_ids].max(prompt_mask > 0)
        seen = jnp.repeat(prompt_seen, g, axis=0)
    t = Turns(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        ids=jnp.full((n, c), cfg.pad_token_id, jnp.int32), logps=jnp.zeros((n, c), jnp.float32),
        sampled=jnp.zeros((n, c), jnp.int32), cursor=jnp.zeros((n,), jnp.int32),
        status=jnp.full((n,), RUNNING, jnp.int32), seen=seen, cache=cache,
    )
    draws = None if cfg.greedy else step_uniforms(key, c, n)  # [C, N]: row r's draw for slot s
    t = _emit(t, logits, jnp.ones((n,), bool), draws, key, cfg)
    return _decode(model, t, draws, key, cfg, pause_at)


def _resume(graphdef: nnx.GraphDef, params: nnx.State, t: Turns, suffix: jax.Array, suffix_len: jax.Array,
            finish: jax.Array, key: jax.Array, cfg: SamplingConfig, pause_at: int) -> Turns:
    model = nnx.merge(graphdef, params)
    n, c = t.ids.shape
    w = suffix.shape[1]
    rows = jnp.arange(n)[:, None]
    extended = (t.status == PAUSED) & (suffix_len > 0) & ~finish
    status = jnp.where(finish, DONE, t.status)
    # the new tokens into the completion after each extended row's last token (the host keeps them within C)
    k = jnp.arange(w)[None, :]
    new = extended[:, None] & (k < suffix_len[:, None])  # [N, T]
    at = jnp.where(new, t.cursor[:, None] + k, c)
    ids = t.ids.at[rows, at].set(suffix.astype(jnp.int32), mode="drop")
    seen = t.seen
    if seen is not None:
        seen = seen.at[rows, suffix].max(new)
    # prefill [last token; new tokens] from the last token's slot: T + 1 keys/values written, one hidden state read
    chunk = jnp.concatenate([_last_tokens(t)[:, None], suffix.astype(jnp.int32)], axis=1)
    valid = extended[:, None] & (jnp.arange(w + 1)[None, :] <= suffix_len[:, None])
    h, cache = model.model.extend(chunk, t.cursor - 1, valid, t.cache)
    last = jnp.take_along_axis(h, jnp.clip(suffix_len, 0, w)[:, None, None], axis=1)[:, 0]  # [N, D]
    t = t.replace(ids=ids, seen=seen, cache=cache, cursor=jnp.where(extended, t.cursor + suffix_len, t.cursor),
                  status=jnp.where(extended, RUNNING, status))
    draws = None if cfg.greedy else step_uniforms(key, c, n)
    t = _emit(t, model.unembed(last), extended, draws, key, cfg)
    return _decode(model, t, draws, key, cfg, pause_at)


def start_turns(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
                key: jax.Array, cfg: SamplingConfig, pause_at: int, mesh: Mesh | None = None) -> Turns:
    """The first turn of every row: prompts [B, P] (any padding) prefilled once each, ``cfg.num_generations`` rows
    per prompt decoded until ``pause_at`` rows have emitted an EOS (PAUSED) or none runs. Jittable (``graphdef``,
    ``cfg``, ``pause_at`` static). ``mesh``: the sampler's layout, as ``sampling.generate_fn``'s."""
    caller = jax.sharding.get_abstract_mesh()
    with _traced_on(mesh):
        inputs = _rows(prompt_ids), _rows(prompt_mask), constrain(key, ())
        t = _start(graphdef, rollout_weights(graphdef, params, caller), *inputs, cfg, pause_at)
    with _traced_on(caller):
        return _placed(t)


def resume_turns(graphdef: nnx.GraphDef, params: nnx.State, turns: Turns, suffix: jax.Array, suffix_len: jax.Array,
                 finish: jax.Array, key: jax.Array, cfg: SamplingConfig, pause_at: int, mesh: Mesh | None = None
                 ) -> Turns:
    """The next turn: PAUSED rows with ``finish`` [N] bool become DONE; PAUSED rows with ``suffix_len`` [N] > 0 get
    ``suffix`` [N, T] (their first suffix_len tokens) appended and prefilled, sample their next token and run on;
    then decoding as ``start_turns``. ``key``: the rollout's (the same for every call)."""
    caller = jax.sharding.get_abstract_mesh()
    with _traced_on(mesh):
        placed = _placed(turns)
        t = _resume(graphdef, rollout_weights(graphdef, params, caller), placed, _rows(suffix), _rows(suffix_len),
                    _rows(finish), constrain(key, ()), cfg, pause_at)
    with _traced_on(caller):
        return _placed(t)


def _placed(t: Turns) -> Turns:
    """Every per-row array laid out by rows on the mesh traced on (the caches by the model's own constraints)."""
    return t.replace(**{name: _rows(getattr(t, name)) for name in ("prompt_ids", "prompt_mask", "ids", "logps",
                                                                   "sampled", "cursor", "status")},
                     seen=None if t.seen is None else _rows(t.seen))


def completions(t: Turns, cfg: SamplingConfig) -> dict[str, jax.Array]:
    """The rollout's completions as the step reads them: ``completion_ids`` [N, C] (pad beyond each row's cursor),
    ``completion_mask`` [N, C] (1 at every real token, the model's and the tools': TRL's attention mask over the
    completion), ``tool_mask`` [N, C] (1 where the model sampled the token: what the loss sees), ``is_truncated``
    [N] (the last token is neither an EOS nor pad: TRL's rule), ``logps`` [N, C] (the sampler's, 0 elsewhere)."""
    c = t.ids.shape[1]
    mask = (jnp.arange(c)[None, :] < t.cursor[:, None]).astype(jnp.int32)
    last = _last_tokens(t)
    ended = _is_eos(last, cfg.eos_token_ids) | (last == cfg.pad_token_id)
    return {"completion_ids": jnp.where(mask > 0, t.ids, cfg.pad_token_id), "completion_mask": mask,
            "tool_mask": t.sampled * mask, "is_truncated": ~ended & (t.cursor > 0), "logps": t.logps * t.sampled}
