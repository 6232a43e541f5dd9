"""NaN-proof differences: the one place the suite's comparison helpers compute "how far apart".

Python's `max` skips a NaN that is not its first argument (`max(0.0, nan) == 0.0`: `nan > 0.0` is False), and both
`nan <= tol` and `nan > tol` are False, so a NaN reduced with `max(<generator>)` or compared with `>` passes silently.
Every helper here raises AssertionError (saying where) when an element is NaN on one side only, or on both sides
unless the caller gives `both_nan=<why that is by design>` (those elements then differ by 0). The numbers returned are
never NaN, so `max` over them and `<=` / `>` checks on them are honest. Infinities: the same infinity on both sides
differs by 0, any other pair holding one differs by inf (which fails every finite tolerance).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def abs_diffs(a: Any, b: Any, where: str = "", both_nan: str | None = None) -> np.ndarray:
    """|a - b| element by element (float64, same shapes), never NaN: raises on a NaN (see the module)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{where}: shapes {a.shape} vs {b.shape}"
    na, nb = np.isnan(a), np.isnan(b)
    _no_nan(na ^ nb, a, b, where, "NaN on one side only")
    if both_nan is None:
        _no_nan(na & nb, a, b, where, "NaN on both sides (pass both_nan=<why> where that is by design)")
    with np.errstate(invalid="ignore"):
        # the same infinity on both sides (inf - inf is NaN) and NaN pairs allowed by design differ by 0
        return np.where((a == b) | (na & nb), 0.0, np.abs(a - b))


def max_abs_diff(a: Any, b: Any, where: str = "", both_nan: str | None = None) -> float:
    """The largest |a - b| over the elements of two arrays (or scalars) of one shape; 0.0 for empty arrays."""
    return float(abs_diffs(a, b, where, both_nan).max(initial=0.0))


def rel_diffs(a: Any, b: Any, where: str = "", both_nan: str | None = None, floor: float = 1e-12) -> np.ndarray:
    """|a - b| / max(|a|, floor) element by element (`a`: the reference side), never NaN (equal infinities: 0)."""
    d = abs_diffs(a, b, where, both_nan)
    scale = np.maximum(np.abs(np.asarray(a, np.float64)), floor)
    with np.errstate(invalid="ignore"):
        return np.where(d == 0, 0.0, np.where(np.isinf(d), np.inf, d / scale))


def worst(values: Iterable[float], where: str = "") -> float:
    """max() that raises on a NaN instead of skipping it (0.0 when empty)."""
    values = [float(v) for v in values]
    assert not any(np.isnan(values)), f"{where}: NaN among {values}"
    return max(values, default=0.0)


def tree_max_abs_diff(a: Any, b: Any, where: str = "", both_nan: str | None = None) -> float:
    """The largest |a - b| over two pytrees with the same leaves (jax / nnx states, dicts of arrays by Hugging Face
    tensor name, nested containers); raises on a NaN, naming the leaf."""
    import jax

    left, _ = jax.tree_util.tree_flatten_with_path(a)
    right, _ = jax.tree_util.tree_flatten_with_path(b)
    paths = [jax.tree_util.keystr(p) for p, _ in left]
    other = [jax.tree_util.keystr(p) for p, _ in right]
    assert paths == other, f"{where}: the trees hold other leaves: {sorted(set(paths) ^ set(other))[:10]}"
    return worst((max_abs_diff(x, y, f"{where} {path}", both_nan)
                  for path, (_, x), (_, y) in zip(paths, left, right, strict=True)), where)


def _no_nan(bad: np.ndarray, a: np.ndarray, b: np.ndarray, where: str, what: str) -> None:
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise AssertionError(f"{where}: {what} at {int(bad.sum())} of {bad.size} elements (first at index "
                             f"{tuple(int(j) for j in i)}: {a[i]} vs {b[i]})")

