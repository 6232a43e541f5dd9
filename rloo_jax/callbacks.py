"""transformers-style callbacks for the training loop: `callbacks=[TrainerCallback, ...]` as TRL's trainers take them.

The loop calls each callback's event methods with TRL's arguments `(args, state, control, **kwargs)`: `args` the run
config, `state` the trainer state (`rloo_jax.rewards.TrainerState`: transformers' `TrainerState` fields), `control`
a `TrainerControl` whose flags the loop honours (`should_training_stop`, `should_save`, `should_evaluate`,
`should_log`). Events: on_init_end, on_train_begin, on_step_begin, on_step_end, on_log (with `logs`), on_evaluate
(with `metrics`), on_save, on_train_end. A callback may return a `TrainerControl` (transformers' convention) or set
the flags on the one it got. A callback that raises stops training with a `CallbackError` naming it; the last
checkpoint is left as it was.

A generation batch's optimizer steps run in one compiled program: their `on_step_begin` events come before it (in
order), their `on_step_end` after it; `should_training_stop` set at any of them ends training after that generation
batch (its steps are done), with `final/` exported as at the planned end.

transformers' own `TrainerCallback` classes work unchanged (they are duck-typed here, so the product never imports
transformers' trainer modules, which import torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

EVENTS = ("on_init_end", "on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_evaluate", "on_save",
          "on_train_end")


class CallbackError(RuntimeError):
    """A callback raised: the message names it and the event; the last checkpoint is intact."""


@dataclasses.dataclass
class TrainerControl:
    """transformers' `TrainerControl`: what callbacks ask the loop to do next."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False


class CallbackHandler:
    """Calls every callback's event in order, threading `control` through them."""

    def __init__(self, callbacks: Iterable[Any] | None = None) -> None:
        self.callbacks: list[Any] = []
        for cb in callbacks or []:
            self.add(cb)
        self.control = TrainerControl()

    def add(self, callback: Any) -> None:
        """A callback instance, or a class (instantiated with no arguments, as transformers does)."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback: Any) -> Any:
        """Remove and return the first callback that is `callback` or an instance of it (a class); None if none."""
        for i, cb in enumerate(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return self.callbacks.pop(i)
        return None

    def call(self, event: str, args: Any, state: Any, **kwargs: Any) -> TrainerControl:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            try:
                result = method(args, state, self.control, **kwargs)
            except Exception as e:  # noqa: BLE001 - user code: named and re-raised
                name = type(cb).__name__
                raise CallbackError(f"callback {name}.{event} raised {type(e).__name__}: {e}; training stopped at "
                                    f"step {getattr(state, 'global_step', '?')}, the last checkpoint is intact") from e
            if result is not None and all(hasattr(result, f) for f in ("should_save", "should_training_stop")):
                self.control = result
        return self.control
