"""rloo_jax.turns: the multi-turn sampler. A turn resumed after new tokens (a tool result) are appended to a row's
own KV cache must equal decoding the whole conversation from scratch (the training forward over [prompt;
completion]): logits within 1e-5 in float32; only the new tokens are prefilled; a bounded number of programs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rloo_jax import sampling, turns
from rloo_jax.models import load_causal_lm
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import completion_logps
from tests.checkpoints import PAD_ID, build_mistral, build_qwen2

PROMPT_IDS = np.array(
    [[0, 0, 0, 0, 17, 90, 41], [5, 210, 33, 8, 150, 77, 64], [0, 0, 120, 9, 250, 31, 3]], np.int32
)
PROMPT_MASK = (PROMPT_IDS != PAD_ID).astype(np.int32)
C = 24
TOL = 1e-5  # float32, measured ~1e-6 (cache vs full forward: the same math in another order)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return load_causal_lm(build_qwen2(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module", params=["qwen2", "mistral_window"])
def model(request, tmp_path_factory, qwen2):
    """Also a model with a sliding window (5 tokens): the window's mask over cache slots and prompt."""
    if request.param == "qwen2":
        return qwen2
    return load_causal_lm(build_mistral(tmp_path_factory.mktemp("mistral"), sliding_window=5))


def full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group):
    """[N, C, V]: the logits that predict each completion slot, from one forward over [prompt; completion]."""
    ids = np.repeat(prompt_ids, group, axis=0)
    mask = np.repeat(prompt_mask, group, axis=0)
    out = model(jnp.concatenate([ids, completion_ids], 1), jnp.concatenate([mask, completion_mask], 1))
    return out[:, ids.shape[1] - 1 : -1]


def test_suffix_buckets():
    assert turns.suffix_buckets(100, 16) == (16, 32, 64, 100)
    assert turns.suffix_buckets(12, 16) == (12,)
    assert turns.suffix_buckets(64, 16) == (16, 32, 64)
    assert turns.suffix_bucket(20, (16, 32, 64)) == 32 and turns.suffix_bucket(16, (16, 32)) == 16
    with pytest.raises(ValueError):
        turns.suffix_bucket(65, (16, 32, 64))


def test_extend_equals_full_forward(model):
    """Rows at different cursors, chunks of different lengths (invalid tokens not written): every chunk's logits
    equal the full forward's at those positions."""
    graphdef, params = nnx.split(model)
    g = 2
    n = PROMPT_IDS.shape[0] * g
    rng = np.random.default_rng(0)
    completion = rng.integers(3, 250, size=(n, C)).astype(np.int32)
    lengths = np.array([5, 9, 1, 12, 7, 3])  # row r's first chunk; the second chunk fills up to `ends`
    ends = np.array([11, 20, 2, 24, 15, 10])

    @jax.jit
    def run(params, chunk1, chunk2):
        m = nnx.merge(graphdef, params)
        _, pc = m.prefill(jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_MASK), C)
        cache = m.init_decode_cache(pc, g, C)
        t = jnp.arange(C)[None]
        l1, cache = m.extend(chunk1, jnp.zeros(n, jnp.int32), t < lengths[:, None], cache)
        l2, cache = m.extend(chunk2, jnp.asarray(lengths, jnp.int32), t < (ends - lengths)[:, None], cache)
        return l1, l2

    chunk2 = np.zeros_like(completion)
    for r in range(n):
        chunk2[r, : ends[r] - lengths[r]] = completion[r, lengths[r] : ends[r]]
    l1, l2 = run(params, jnp.asarray(completion), jnp.asarray(chunk2))
    # the logits after completion token j predict slot j + 1: full_logits[:, j + 1]
    mask = (np.arange(C)[None] < ends[:, None]).astype(np.int32)
    expected = np.asarray(full_logits(model, PROMPT_IDS, PROMPT_MASK, completion, mask, g))
    for r in range(n):
        for j in range(ends[r] - 1):
            got = l1[r, j] if j < lengths[r] else l2[r, j - lengths[r]]
            np.testing.assert_allclose(got, expected[r, j + 1], atol=TOL, err_msg=f"row {r} token {j}")


class ScriptedTool:
    """A deterministic host: a row that paused after an odd number of turns is given `3 + row % 4` new tokens
    (its last 2 tokens shifted, then 5, 6, 7 ...), others are finished; counts what it prefilled."""

    def __init__(self, eos_ids):
        self.eos_ids = eos_ids
        self.prefilled = 0
        self.turns = {}

    def __call__(self, ids, cursor, status, width):
        n = ids.shape[0]
        suffix = np.zeros((n, width), np.int32)
        lengths = np.zeros(n, np.int32)
        finish = np.zeros(n, bool)
        for r in np.flatnonzero(status == turns.PAUSED):
            done = self.turns.get(r, 0)
            self.turns[r] = done + 1
            k = 3 + r % 4
            if done >= 2 or cursor[r] + k > ids.shape[1]:
                finish[r] = True
                continue
            tokens = [int(ids[r, cursor[r] - 1]) % 200 + 40, int(ids[r, cursor[r] - 2]) % 200 + 40, 5, 6, 7, 8][:k]
            suffix[r, :k] = tokens
            lengths[r] = k
            self.prefilled += k
        return suffix, lengths, finish


def programs(model, cfg, pause_at):
    graphdef, _ = nnx.split(model)
    return (jax.jit(functools.partial(turns.start_turns, graphdef, cfg=cfg, pause_at=pause_at)),
            jax.jit(functools.partial(turns.resume_turns, graphdef, cfg=cfg, pause_at=pause_at)))


def run_turns(model, cfg, host, pause_at, key=0, width=8, jitted=None):
    _, params = nnx.split(model)
    start, resume = jitted or programs(model, cfg, pause_at)
    k = jax.random.key(key)
    t = start(params, PROMPT_IDS, PROMPT_MASK, k)
    calls = 0
    while True:
        status = np.asarray(t.status)
        if not (status == turns.PAUSED).any() and not (status == turns.RUNNING).any():
            break
        suffix, lengths, finish = host(np.asarray(t.ids), np.asarray(t.cursor), status, width)
        t = resume(params, t, suffix, lengths, finish, k)
        calls += 1
    return t, calls, (start, resume)


EOS = tuple(range(3, 40))  # ~13% of the vocabulary: rows pause early and at different slots


def test_resumed_turns_equal_the_whole_conversation_from_scratch(model):
    """Greedy, G 2: tokens are the full forward's argmax and the sampler's log-probs the training forward's, at
    every model token of every turn; tool tokens are in the completion (attended) but out of the tool mask."""
    cfg = SamplingConfig(max_new_tokens=C, num_generations=2, temperature=0.0, eos_token_ids=EOS, pad_token_id=PAD_ID)
    host = ScriptedTool(EOS)
    t, calls, _ = run_turns(model, cfg, host, pause_at=6)
    out = jax.tree.map(np.asarray, turns.completions(t, cfg))
    ids, mask, tool = out["completion_ids"], out["completion_mask"], out["tool_mask"]
    assert calls >= 2 and (mask.sum(1) > tool.sum(1)).sum() >= 3, "weak test: too few tool turns"
    logits = np.asarray(full_logits(model, PROMPT_IDS, PROMPT_MASK, ids, mask, 2))
    top2 = np.sort(logits, axis=-1)[..., -2:]
    for r, j in zip(*np.nonzero(tool), strict=True):
        assert ids[r, j] == logits[r, j].argmax(), (r, j)
        assert top2[r, j, 1] - top2[r, j, 0] > 1e-3, "a near tie: a flaky test"
    graphdef, params = nnx.split(model)
    train = completion_logps(graphdef, params, PROMPT_IDS, PROMPT_MASK, ids, mask, 1.0)
    np.testing.assert_allclose(out["logps"], np.asarray(train) * tool, atol=TOL)
    # each row: model tokens, then tool tokens where the host gave some, ...; EOS ends every model turn but the last
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        assert (ids[r, n:] == PAD_ID).all() and (tool[r, n:] == 0).all()
        turn_ends = [j for j in range(n - 1) if tool[r, j] and not tool[r, j + 1]]
        assert all(ids[r, j] in EOS for j in turn_ends)
    assert host.prefilled == int((mask - tool).sum())  # only the new tokens were prefilled


def test_the_schedule_changes_nothing_when_sampling(qwen2):
    model = qwen2
    """Sampling (T 0.8, top-k 50): the host resuming rows one at a time (pause_at 1) or all together (pause_at N)
    gives the same tokens: a row's draws depend on its completion slot only."""
    cfg = SamplingConfig(max_new_tokens=C, num_generations=2, temperature=0.8, top_k=50, eos_token_ids=EOS,
                         pad_token_id=PAD_ID)
    one, calls_one, _ = run_turns(model, cfg, ScriptedTool(EOS), pause_at=1, key=3)
    all_, calls_all, _ = run_turns(model, cfg, ScriptedTool(EOS), pause_at=6, key=3)
    assert calls_one > calls_all
    for name in ("ids", "logps", "sampled", "cursor"):
        np.testing.assert_array_equal(getattr(one, name), getattr(all_, name))


def test_no_tool_call_samples_what_the_single_turn_sampler_samples(qwen2):
    model = qwen2
    cfg = SamplingConfig(max_new_tokens=C, num_generations=3, temperature=0.7, top_p=0.9, eos_token_ids=EOS,
                         pad_token_id=PAD_ID)

    def finish_all(ids, cursor, status, width):
        n = ids.shape[0]
        return np.zeros((n, width), np.int32), np.zeros(n, np.int32), status == turns.PAUSED

    t, _, _ = run_turns(model, cfg, finish_all, pause_at=9, key=5)
    out = turns.completions(t, cfg)
    graphdef, params = nnx.split(model)
    gen = jax.jit(functools.partial(sampling.generate_fn, graphdef, cfg=cfg))(params, PROMPT_IDS, PROMPT_MASK,
                                                                              jax.random.key(5))
    np.testing.assert_array_equal(out["completion_ids"], gen.completion_ids)
    np.testing.assert_array_equal(out["completion_mask"], gen.completion_mask)
    np.testing.assert_array_equal(out["is_truncated"], gen.is_truncated)
    np.testing.assert_allclose(out["logps"], gen.logps, atol=TOL)


def test_one_program_per_suffix_bucket(qwen2):
    model = qwen2
    """Any number of turns compiles start once and resume once per suffix width."""
    cfg = SamplingConfig(max_new_tokens=C, num_generations=2, temperature=0.0, eos_token_ids=EOS, pad_token_id=PAD_ID)
    jitted = programs(model, cfg, 1)
    _, calls, (start, resume) = run_turns(model, cfg, ScriptedTool(EOS), pause_at=1, jitted=jitted)
    assert calls >= 4
    assert start._cache_size() == 1 and resume._cache_size() == 1
    run_turns(model, cfg, ScriptedTool(EOS), pause_at=1, key=1, jitted=jitted)
    run_turns(model, cfg, ScriptedTool(EOS), pause_at=1, width=16, jitted=jitted)
    assert start._cache_size() == 1 and resume._cache_size() == 2


def _scattered_shapes(jaxpr):
    """The operand shapes of every scatter in `jaxpr` and its sub-jaxprs (loops, scans, remat)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter"):
            out.append(tuple(eqn.invars[0].aval.shape))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            out += _scattered_shapes(sub)
    return out


def test_turns_write_the_kv_cache_without_a_scatter(qwen2):
    """The KV cache [L, N, K, C, Dh] is written by a select over one layer's slice, put back in place, not scattered
    into: on a TPU the compiler copied the whole scattered cache into another layout and back at every layer of
    every decode step (162 GB a step per chip for Qwen2.5-1.5B on a v5e-8, against 5.9 GB with the select and a
    4.1 GB floor: BENCHMARKS.md Session 17). Both the first turn (decoding) and a resumed one (T new tokens)."""
    cfg = SamplingConfig(max_new_tokens=C, num_generations=2, eos_token_ids=EOS, pad_token_id=PAD_ID)
    graphdef, params = nnx.split(qwen2)
    start = jax.make_jaxpr(lambda p, i, m, k: turns.start_turns(graphdef, p, i, m, k, cfg, 6))(
        params, PROMPT_IDS, PROMPT_MASK, jax.random.key(0))
    t = jax.eval_shape(lambda p, i, m, k: turns.start_turns(graphdef, p, i, m, k, cfg, 6), params, PROMPT_IDS,
                       PROMPT_MASK, jax.random.key(0))
    n = t.ids.shape[0]
    resume = jax.make_jaxpr(lambda p, tt, s, sl, f, k: turns.resume_turns(graphdef, p, tt, s, sl, f, k, cfg, 6))(
        params, t, jnp.zeros((n, 16), jnp.int32), jnp.ones((n,), jnp.int32), jnp.zeros((n,), bool),
        jax.random.key(0))
    for program in (start, resume):
        caches = [s for s in _scattered_shapes(program.jaxpr) if len(s) == 5]
        assert caches == [], caches
