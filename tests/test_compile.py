"""Recompilation counting: after the first step, a run with varied prompt lengths compiles nothing.

Compilations are counted with jax's monitoring events (one `/jax/core/compile/backend_compile_duration` event per
XLA compile, one `/jax/compilation_cache/cache_hits` per executable the suite's persistent cache supplied instead, one
`/jax/core/compile/jaxpr_trace_duration` per trace), so every jitted function counts, including eager jnp calls
between the steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rloo_jax.algorithms import GRPO, RLOO
from rloo_jax.models import init_causal_lm
from rloo_jax.programs import Programs, flat_metrics
from rloo_jax.sampling import SamplingConfig, bucket_prompts
from rloo_jax.step import StepConfig, completion_width

COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # a compile the persistent cache (tests/conftest.py) answered
TRACE = "/jax/core/compile/jaxpr_trace_duration"
VOCAB, PAD, EOS = 64, 0, 1
TINY = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
            tie_word_embeddings=False)


@contextlib.contextmanager
def count_compiles() -> Iterator[dict[str, int]]:
    """Counts XLA compiles and jaxpr traces inside the block: yields {"compiles": n, "traces": m}."""
    counts = {"compiles": 0, "traces": 0}

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == COMPILE:
            counts["compiles"] += 1
        elif event == TRACE:
            counts["traces"] += 1

    def hits(event: str, **kwargs: object) -> None:
        if event == CACHE_HIT:
            counts["compiles"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(hits)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(hits)


def _prompts(rng: np.random.Generator, num_prompts: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts of random length 1..bucket, put into the one bucket the trainer would use."""
    lengths = rng.integers(1, bucket + 1, num_prompts)
    ids = np.full((num_prompts, bucket), PAD, np.int32)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(2, VOCAB, n)
        mask[b, :n] = 1
    return bucket_prompts(ids, mask, bucket, PAD)


@pytest.mark.parametrize("algorithm", [RLOO(beta=0.05), GRPO(beta=0.04, loss_type="dapo", entropy_coef=0.01,
                                                             use_adaptive_entropy=True)], ids=["rloo", "grpo"])
def test_no_recompilation_after_first_step(algorithm):
    """Steps 2..N of rollout -> host reward -> update, prompt lengths varying inside one bucket: 0 compiles (GRPO's
    entropy controller state changes every step: data, not a new program)."""
    graphdef, params = nnx.split(init_causal_lm(TINY, seed=0))
    sc = SamplingConfig(max_new_tokens=6, num_generations=2, eos_token_ids=(EOS,), pad_token_id=PAD)
    step = Programs(graphdef, optax.adamw(1e-3), StepConfig(sampling=sc, algorithm=algorithm))
    state = step.init_state(params, jax.tree.map(jnp.copy, params))
    weights = jnp.ones((1,), jnp.float32)
    rng = np.random.default_rng(0)
    base_key = jax.random.key(0)

    prompt_lengths = []

    def one_step(i: int, state: object) -> tuple[object, dict]:
        ids, mask = _prompts(rng, 3, bucket=8)
        prompt_lengths.append(tuple(mask.sum(axis=1)))
        rollout = step.rollout(state, ids, mask, jax.random.fold_in(base_key, i))
        completions = np.asarray(rollout.completion_ids)
        rewards = jnp.asarray((completions % 3 == 0).mean(axis=1, keepdims=True), jnp.float32)
        state, metrics = step.update(state, rollout, rewards, weights)
        metrics = flat_metrics(metrics)
        return state, jax.device_get(metrics)

    with count_compiles() as first:
        state, _ = one_step(0, state)
    assert first["compiles"] >= 2  # rollout and update at least: the counter works
    with count_compiles() as later:
        for i in range(1, 8):
            state, metrics = one_step(i, state)
            assert np.isfinite(metrics["loss"])
    print(f"first step: {first}; steps 2-8: {later}")
    assert later == {"compiles": 0, "traces": 0}
    assert len(set(prompt_lengths)) > 4  # the prompt lengths really varied


def test_bucketed_widths_compile_once_each():
    """The trainer's path (sample -> longest -> finish and update at the completion width): a program per width
    the first time that width occurs, nothing after; the widths are the buckets 4, 8, 16 of a 16-token maximum."""
    from tests.test_step import early_ending

    graphdef, params = nnx.split(init_causal_lm(TINY, seed=0))
    sc = SamplingConfig(max_new_tokens=16, num_generations=2, eos_token_ids=(EOS,), pad_token_id=PAD)
    step = Programs(graphdef, optax.adamw(1e-3), StepConfig(sampling=sc, algorithm=RLOO(beta=0.05)))
    state = step.init_state(params, jax.tree.map(jnp.copy, params))
    weights, rng = jnp.ones((1,), jnp.float32), np.random.default_rng(1)
    ids, mask = _prompts(rng, 3, bucket=8)
    seen, log = set(), []
    for i, longest in enumerate([3, 7, 2, 12, 8, 15, 1, 5, 16]):
        with count_compiles() as counts:
            sampled = step.sample(state, ids, mask, jax.random.key(i))
            ends = rng.integers(0, longest, 6)
            ends[0] = longest - 1
            no_eos = sampled.replace(completion_ids=sampled.completion_ids.at[0].set(EOS + 1))  # runs to the end
            sampled = early_ending(sampled, ends, EOS, PAD) if longest < 16 else no_eos
            width = completion_width(step.longest(sampled), 16, 4)
            rollout = step.finish(state, sampled, width)
            state, _ = step.update(state, rollout, jnp.zeros((6, 1), jnp.float32), weights)
        log.append((width, counts["compiles"]))
        if i > 0:  # finish and update once per new width (the step's small helpers compiled at step 1)
            assert counts["compiles"] == (0 if width in seen else 2), log
        seen.add(width)
    assert seen == {4, 8, 16} and [w for w, _ in log] == [4, 8, 4, 16, 8, 16, 4, 8, 16]
