"""Checkpoints: exact round trip of the train state, key and data position; half-written ones are ignored."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rloo_jax import demo
from rloo_jax.checkpoint import Checkpointer
from rloo_jax.models import init_causal_lm
from rloo_jax.step import TrainState


def make_state(seed, with_ref=False):
    params = nnx.state(init_causal_lm(demo.MODEL_CONFIG, seed=seed), nnx.Param)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)  # non-trivial moments
    ref = jax.tree.map(lambda x: x * 0.5, params) if with_ref else None
    return TrainState(params=params, opt_state=opt_state, ref_params=ref, step=jnp.asarray(seed, jnp.int32))


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    saved = make_state(7, with_ref=True)
    key = jax.random.fold_in(jax.random.key(0), 11)
    meta = {"data": {"epoch": 2, "index": 16, "num_rows": 40, "seed": 0}, "step": 7}
    ckpt.save(7, saved, key, meta)
    ckpt.close()
    again = Checkpointer(tmp_path / "checkpoints")
    assert again.latest_step() == 7
    state, key2, meta2 = again.restore(7, make_state(1, with_ref=True), jax.random.key(5))
    assert_trees_equal(state, saved)
    assert isinstance(state, TrainState) and int(state.step) == 7
    np.testing.assert_array_equal(jax.random.key_data(key2), jax.random.key_data(key))
    assert meta2 == meta
    again.close()


def test_without_reference_and_max_to_keep(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, make_state(step), jax.random.key(step), {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    state, _, meta = ckpt.restore(3, make_state(0), jax.random.key(0))
    assert state.ref_params is None and meta == {"step": 3} and int(state.step) == 3
    ckpt.close()


def test_half_written_checkpoint_is_not_picked_up(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(4, make_state(4), jax.random.key(4), {"step": 4})
    ckpt.close()
    # what a crash in the middle of saving step 9 leaves behind: orbax's temporary folder
    os.makedirs(tmp_path / "9.orbax-checkpoint-tmp-1700000000" / "state")
    (tmp_path / "9.orbax-checkpoint-tmp-1700000000" / "state" / "junk").write_text("partial")
    again = Checkpointer(tmp_path)
    assert again.latest_step() == 4 and again.all_steps() == [4]
    state, _, _ = again.restore(again.latest_step(), make_state(0), jax.random.key(0))
    assert int(state.step) == 4
    again.close()


def test_empty_directory_has_no_latest(tmp_path):
    ckpt = Checkpointer(tmp_path / "none")
    assert ckpt.latest_step() is None
    ckpt.close()


def test_a_checkpoint_from_before_a_state_field_restores(tmp_path):
    """A checkpoint written before TrainState grew a field (value_params, reward_params) restores with that field
    None; asking a checkpoint for a field it does not hold (a value model) is refused."""
    import flax.struct
    import pytest

    @flax.struct.dataclass
    class Before:  # TrainState as it was: no value_params / reward_params
        params: object
        opt_state: object
        ref_params: object
        step: jax.Array
        frozen: object = None
        algo_state: object = None

    state = make_state(3)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, Before(state.params, state.opt_state, None, state.step), jax.random.key(0), {"step": 1})
    restored, _, _ = ckpt.restore(1, make_state(0), jax.random.key(0))
    assert restored.value_params is None and restored.reward_params is None
    assert_trees_equal(restored.params, state.params)
    with pytest.raises(ValueError, match="checkpoint 1 holds no value_params"):
        ckpt.restore(1, make_state(0).replace(value_params=state.params), jax.random.key(0))
