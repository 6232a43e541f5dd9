"""TRL's logging window: a record per logged optimizer step, each metric the mean of what its steps produced.

TRL (transformers' Trainer and its `_metrics` lists) logs every `logging_steps` optimizer steps the mean of every
value appended since the last log: the generation batch's metrics once, when it is generated (rewards, lengths);
what the loss computes once per micro-batch (clip ratios, KL, entropy); the loss once per optimizer step (the sum of
its micro-batches' scaled losses); and `grad_norm` of the last step only. NaN values are left out of a mean (a
metric with no finite value logs None). `steps(metrics, u)` turns one generation batch's `Step.update` metrics into
what each of its optimizer steps adds; `LogWindow` keeps the values until the next log.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

LAST = ("grad_norm",)  # the Trainer logs the last optimizer step's grad norm, not a mean over the window


def steps(metrics: dict[str, dict[str, Any]]) -> Iterator[dict[str, list[float]]]:
    """One generation batch's metrics (host copies of ``Step.update``'s ``generation`` scalars, ``micro`` ``[U, M]``
    and ``update`` ``[U]`` arrays) -> for each of its U optimizer steps, ``{name: values it appends}``: the
    generation metrics with its first step, its M micro-batch values, its own update values.

    Example: generation {reward: 1}, micro {kl: [[1, 2], [3, 4]]}, update {loss: [5, 6]} -> step 0: {reward: [1],
    kl: [1, 2], loss: [5]}, step 1: {kl: [3, 4], loss: [6]}.
    """
    updates = next(iter(metrics["update"].values())).shape[0]
    micro = int(np.size(next(iter(metrics["micro"].values())))) if metrics["micro"] else updates
    records, _ = planned_steps(metrics, carried=0, gas=micro // updates, pending={}, run=micro)
    yield from records


def planned_steps(metrics: dict[str, dict[str, Any]], carried: int, gas: int, pending: dict[str, list[float]],
                  run: int) -> tuple[list[dict[str, list[float]]], dict[str, list[float]]]:
    """``steps`` for an update program run under an ``rloo_jax.step.UpdatePlan``: its ``run`` micro-batch values
    (``micro``, ``[U, M]`` or ``[run]``, taken in order) belong to the optimizer steps they accumulate into, the first
    ``gas - carried`` to the step begun earlier (whose values so far are ``pending``); the generation metrics go
    with the step holding the generation's first micro-batch (TRL appends them when it generates); ``update``
    ``[S]`` are the S completed steps' own. Returns (the completed steps' values, the values of the step still
    open: pending for the next generation batch's program).

    Example: gas 2, carried 1, pending {kl: [1]}, generation {reward: 7}, micro {kl: [2, 3, 4]}, update {loss: [5,
    6]}, run 3 -> steps [{kl: [1, 2], reward: [7], loss: [5]}, {kl: [3, 4], loss: [6]}], pending {}.
    """
    micro = {name: [float(v) for v in np.ravel(vs)] for name, vs in metrics["micro"].items()}
    updates = {name: [float(v) for v in np.ravel(vs)] for name, vs in metrics["update"].items()}
    current = {name: list(vs) for name, vs in pending.items()}

    def add(values: dict[str, list[float]]) -> None:
        for name, vs in values.items():
            current.setdefault(name, []).extend(vs)

    add({name: [float(v)] for name, v in metrics["generation"].items()})
    records, start, u = [], 0, 0
    while start < run:
        end = min(run, (u + 1) * gas - carried)
        add({name: vs[start:end] for name, vs in micro.items()})
        if end == (u + 1) * gas - carried:  # the step's last micro-batch: it completed here
            add({name: [vs[u]] for name, vs in updates.items()})
            records.append(current)
            current, u = {}, u + 1
        start = end
    return records, current


class LogWindow:
    """The values appended since the last log, per metric (host floats: JSON-ready for the checkpoint)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, values: dict[str, list[float]]) -> None:
        for name, vs in values.items():
            self.values.setdefault(name, []).extend(vs)

    def read(self) -> dict[str, float | None]:
        """Each metric's mean over its finite values (None when it has none, as TRL), ``LAST`` metrics their last
        value; resets the window. Example: {kl: [1, nan, 3], grad_norm: [2, 5]} -> {kl: 2, grad_norm: 5}."""
        out: dict[str, float | None] = {}
        for name, vs in self.values.items():
            if name in LAST:
                out[name] = vs[-1]
                continue
            finite = [v for v in vs if not math.isnan(v)]
            out[name] = sum(finite) / len(finite) if finite else None
        self.values = {}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The unread window (NaN/inf as strings: not JSON numbers), so a checkpoint taken between two logged steps
        resumes to the same logged means."""
        return {"values": values_to_json(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = values_from_json(state.get("values", {}))


def values_to_json(values: dict[str, list[float]]) -> dict[str, list[Any]]:
    """Metric values for a checkpoint's JSON meta: NaN/inf as strings (not JSON numbers)."""
    return {k: [v if math.isfinite(v) else repr(v) for v in vs] for k, vs in values.items()}


def values_from_json(values: dict[str, list[Any]]) -> dict[str, list[float]]:
    return {k: [float(v) for v in vs] for k, vs in values.items()}
