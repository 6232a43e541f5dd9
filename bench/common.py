"""Shared pieces of the in-process benchmarks: the tiny/small Qwen2 configs of bench_rloo_step.py, prompts, a step.

Models are randomly initialised in-process (`init_causal_lm`, same shapes as the checkpoints bench_rloo_step.py
builds), so these scripts need no files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rloo_jax.backend import cpu_compile_flags  # noqa: E402

cpu_compile_flags()  # the trainer's XLA flags, so in-process figures match `python -m rloo_jax.train`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from rloo_jax.algorithms import RLOO  # noqa: E402
from rloo_jax.models import init_causal_lm  # noqa: E402
from rloo_jax.programs import Programs  # noqa: E402
from rloo_jax.sampling import SamplingConfig  # noqa: E402
from rloo_jax.step import StepConfig  # noqa: E402

VOCAB, PAD_ID, EOS_ID = 836, 0, 1
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=8),
}


def hf_config(size: str, vocab: int = VOCAB) -> dict:
    return dict(model_type="qwen2", vocab_size=vocab, max_position_embeddings=2048, pad_token_id=PAD_ID,
                eos_token_id=EOS_ID, bos_token_id=EOS_ID, tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_theta=10000.0, hidden_act="silu", **SIZES[size])


def make_step(size: str, dtype: str = "float32", num_prompts: int = 2, group: int = 4, new_tokens: int = 32,
              beta: float = 0.05, seed: int = 0) -> tuple[Programs, object]:
    """The trainer's step for the bench settings (clip 1.0 -> AdamW lr 1e-5) and a fresh state."""
    model = init_causal_lm(hf_config(size), seed=seed, dtype=dtype, param_dtype="float32")
    graphdef, params = nnx.split(model)
    sc = SamplingConfig(max_new_tokens=new_tokens, num_generations=group, temperature=1.0,
                        eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, weight_decay=0.0))
    step = Programs(graphdef, opt, StepConfig(sampling=sc, algorithm=RLOO(beta=beta)))
    ref = jax.tree.map(jnp.copy, params) if beta else None
    return step, step.init_state(params, ref)


def prompts(num_prompts: int, bucket: int = 32, lo: int = 8, hi: int = 24, seed: int = 0
            ) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded random prompts of lo..hi tokens, padded to `bucket` columns (ids avoid pad/eos)."""
    rng = np.random.default_rng(seed)
    ids = np.full((num_prompts, bucket), PAD_ID, np.int32)
    mask = np.zeros_like(ids)
    for b in range(num_prompts):
        n = int(rng.integers(lo, hi + 1))
        ids[b, bucket - n:] = rng.integers(2, VOCAB, n)
        mask[b, bucket - n:] = 1
    return ids, mask


def distinct_reward(completion_ids: np.ndarray) -> np.ndarray:
    """The bench reward (fraction of distinct tokens), on ids: [N, C] -> [N, 1] float32."""
    out = []
    for row in completion_ids:
        toks = [t for t in row.tolist() if t != PAD_ID]
        out.append(len(set(toks)) / max(len(toks), 1))
    return np.asarray(out, np.float32)[:, None]


def timeit(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn() (fn must block on its result)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def matmul_peak(n: int = 1024, dtype: str = "float32", repeats: int = 20) -> float:
    """Measured FLOP/s of one jitted n x n x n matmul on this machine (best of `repeats`)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = min(timeit(lambda: f(a, a).block_until_ready(), repeats))
    return 2 * n**3 / best
