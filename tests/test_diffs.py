"""The comparison helpers fail on a NaN (tests/diffs.py): a NaN on TRL's side (or ours) in a logged metric or a final
weight fails the whole-trainer parity helpers instead of counting as equal, as `max(0.0, nan) == 0.0` made it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import ppo_parity as pp
from tests import trainer_parity as tp
from tests.diffs import abs_diffs, max_abs_diff, rel_diffs, tree_max_abs_diff, worst

NAN = float("nan")


def test_python_max_skips_nan():
    """Why the helpers exist: Python's max keeps its first argument against a NaN, so a NaN reduced with it (or
    compared with <= / >) passes every check."""
    assert max(0.0, NAN) == 0.0 and max(x for x in [1e-7, NAN]) == 1e-7
    assert not (NAN <= 1e-5) and not (NAN > 1e-5)


def test_differences_are_exact_and_can_fail_a_tolerance():
    assert max_abs_diff([1.0, 2.0, -3.0], [1.0, 2.5, -3.25]) == 0.5
    np.testing.assert_array_equal(abs_diffs([1.0, 2.0], [1.5, 2.0]), [0.5, 0.0])
    np.testing.assert_allclose(rel_diffs([2.0, 0.0, -4.0], [2.5, 1e-13, -4.0]), [0.25, 0.1, 0.0])
    assert max_abs_diff(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    with pytest.raises(AssertionError, match="shapes"):
        max_abs_diff([1.0, 2.0], [1.0])
    # infinities: the same one on both sides differs by 0, anything else by inf (fails every finite tolerance)
    assert max_abs_diff([math.inf, -math.inf], [math.inf, -math.inf]) == 0.0
    assert max_abs_diff([math.inf], [1.0]) == math.inf and max_abs_diff([math.inf], [-math.inf]) == math.inf
    assert rel_diffs([math.inf], [1.0])[0] == math.inf and rel_diffs([math.inf], [math.inf])[0] == 0.0


@pytest.mark.parametrize("side", ["first", "second"])
def test_nan_on_either_side_raises(side):
    a, b = [0.5, 0.25, 1.0], [0.5, 0.25, NAN]
    if side == "first":
        a, b = b, a
    for f in (abs_diffs, max_abs_diff, rel_diffs):
        with pytest.raises(AssertionError, match="NaN on one side only at 1 of 3 elements .first at index .2,."):
            f(a, b, "here")
    with pytest.raises(AssertionError, match="here: NaN on one side only"):
        max_abs_diff(NAN, 0.7, "here")  # scalars


def test_nan_on_both_sides_raises_unless_the_caller_says_why():
    a, b = np.array([[1.0, NAN], [2.0, 3.0]]), np.array([[1.25, NAN], [2.0, 3.0]])
    with pytest.raises(AssertionError, match=r"NaN on both sides .* at 1 of 4 elements \(first at index \(0, 1\)"):
        max_abs_diff(a, b)
    assert max_abs_diff(a, b, both_nan="a row without any valid token has no mean") == 0.25
    np.testing.assert_array_equal(rel_diffs(a, b, both_nan="test"), [[0.25, 0.0], [0.0, 0.0]])


def test_weight_trees_fail_on_a_nan_in_any_leaf():
    """A NaN in the last leaf of a jax pytree, or one tensor of a dict of weights: the old
    `max(float(np.max(np.abs(a - b))) for ...)` returned the other leaves' 1e-3; the helper raises, naming the leaf."""
    ours = {"a": jnp.zeros(3), "b": {"c": jnp.ones((2, 2)), "d": jnp.array([1.0, 2.0])}}
    theirs = {"a": jnp.full(3, 1e-3), "b": {"c": jnp.ones((2, 2)), "d": jnp.array([1.0, NAN])}}
    old = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
              for x, y in zip(jax.tree.leaves(theirs), jax.tree.leaves(ours), strict=True))
    assert old == pytest.approx(1e-3)  # the pattern the helpers replace: the NaN vanished
    with pytest.raises(AssertionError, match=r"weights \['b'\]\['d'\]: NaN on one side only"):
        tree_max_abs_diff(theirs, ours, "weights")
    theirs["b"]["d"] = jnp.array([1.0, 2.0])
    assert tree_max_abs_diff(theirs, ours) == pytest.approx(1e-3)
    with pytest.raises(AssertionError, match="other leaves"):
        tree_max_abs_diff({"x": np.zeros(2)}, {"y": np.zeros(2)})
    with pytest.raises(AssertionError, match="NaN among"):
        worst([0.0, NAN])


# --------------------------------------------------------------------------- the whole-trainer parity helpers
def _trl_run(loss: float, weight: float = 0.5) -> dict:
    records = [{"step": s, "loss": v, "grad_norm": 1.0, "kl": None} for s, v in ((1, 0.7), (2, loss))]
    return {"records": records, "completions": [[5, 6, 1]],
            "weights": {"model.embed_tokens.weight": np.full((2, 2), 0.5, np.float32),
                        "lm_head.weight": np.array([0.25, weight], np.float32)}}


def test_trl16_parity_helper_fails_on_a_nan_on_trls_side():
    """tests/trainer_parity.compare: TRL logging NaN for step 2's loss against our 0.7 fails (it compared as 0
    difference); a NaN in one of TRL's final weights fails; the same runs without NaN compare as equal."""
    ours = _trl_run(0.7)
    assert tp.compare(_trl_run(0.7), ours)["metrics"]["loss"] == (0.0, 0.0)
    assert tp.compare(_trl_run(0.7), ours)["weights"] == 0.0
    with pytest.raises(AssertionError, match="step 2 loss .TRL vs ours.: NaN on one side only"):
        tp.compare(_trl_run(NAN), ours)
    with pytest.raises(AssertionError, match="step 2 loss .TRL vs ours.: NaN on one side only"):
        tp.compare(ours, _trl_run(NAN))  # ours NaN
    with pytest.raises(AssertionError, match="NaN on both sides"):
        tp.compare(_trl_run(NAN), _trl_run(NAN))
    with pytest.raises(AssertionError, match=r"final weights .TRL vs ours. \['lm_head.weight'\]: NaN on one side"):
        tp.compare(_trl_run(0.7, weight=NAN), ours)
    # a difference beyond the tolerance is reported as such
    assert tp.compare(_trl_run(0.8), ours)["metrics"]["loss"] == (pytest.approx(0.1), pytest.approx(0.125))


def _ppo_side(value: float, weight: float = 0.25, key: str = "records") -> dict:
    logs = [{name: 1.0 for name in pp.METRICS} for _ in range(pp.UPDATES)]
    logs[-1]["objective/kl"] = value
    return {key: logs, "weights": {"policy/lm_head.weight": np.array([0.5, weight]),
                                   "value/score.weight": np.array([0.125])}}


def test_trl112_ppo_parity_helper_fails_on_a_nan_on_trls_side():
    """tests/ppo_parity.compare: a NaN in TRL's last update's objective/kl, or in one of TRL's final weights."""
    ours = _ppo_side(1.0)
    result = pp.compare(_ppo_side(1.0, key="logs"), ours)
    assert result["weights"] == 0.0 and all(v == (0.0, 0.0) for v in result["metrics"].values())
    with pytest.raises(AssertionError, match="objective/kl over the updates .TRL vs ours.: NaN on one side only"):
        pp.compare(_ppo_side(NAN, key="logs"), ours)
    with pytest.raises(AssertionError, match=r"\['policy/lm_head.weight'\]: NaN on one side only"):
        pp.compare(_ppo_side(1.0, weight=NAN, key="logs"), ours)
    with pytest.raises(AssertionError, match="NaN on one side only"):
        pp.compare(_ppo_side(1.0, weight=NAN, key="logs"), ours, "policy/")
    assert pp.compare(_ppo_side(1.0, weight=NAN, key="logs"), ours, "value/")["weights"] == 0.0  # not compared
    assert pp.compare(_ppo_side(1.5, key="logs"), ours)["metrics"]["objective/kl"] == (0.5, pytest.approx(1 / 3))

