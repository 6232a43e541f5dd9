"""Checkpoints: `<output_dir>/checkpoints/<step>/` through orbax's CheckpointManager (async saves).

A checkpoint holds everything needed to resume exactly: the `TrainState` (params, optimizer state, reference
params when kept, step), the RNG key, and a JSON `meta` item (the data iterator position and run facts).
orbax writes into a temporary folder and renames it when complete, so a half-written checkpoint (a crash
mid-save) is never listed, never restored; the next run deletes such leftovers. On object stores (`gs://`), which
cannot rename, orbax marks a complete checkpoint with a `commit_success.txt` written last instead. A state holding
NaN/inf is refused (`NonFiniteError`) before anything is written.
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rloo_jax import outputs

ITEMS = ("state", "meta")  # the items of a checkpoint


def saved_steps(output_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in `<output_dir>/checkpoints`, ascending ([] when none), read only."""
    directory = outputs.join(output_dir, "checkpoints")
    if not outputs.exists(directory):
        return []
    options = ocp.CheckpointManagerOptions(read_only=True)
    return sorted(ocp.CheckpointManager(outputs.resolve(directory), options=options, item_names=ITEMS).all_steps())


class NonFiniteError(RuntimeError):
    """Training produced NaN/inf (in the loss, the gradients or the state); nothing non-finite is saved."""


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the floating-point leaves of `tree` holding NaN or inf ([] when all finite; one device sync)."""
    leaves = [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not leaves:
        return []
    flags = jax.device_get(_all_finite([x for _, x in leaves]))
    return [name for (name, _), ok in zip(leaves, flags, strict=True) if not ok]


@jax.jit
def _all_finite(xs: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(x)) for x in xs]


class Checkpointer:
    """Save / find / restore training checkpoints under one directory."""

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = None, async_save: bool = True) -> None:
        self.directory = outputs.join(directory)  # an absolute local path or a URL (gs://...): orbax takes both
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True
        )
        # the handlers named up front: a new manager (a resumed run) can then read a step's item metadata, which
        # `restore` needs to see what fields the checkpoint holds (orbax gives None for an unregistered item)
        handlers = dict(zip(ITEMS, (ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()), strict=True))
        self._manager = ocp.CheckpointManager(outputs.resolve(self.directory), options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, key: jax.Array, meta: dict[str, Any]) -> None:
        """Start saving (returns before the write finishes; `wait()` or `close()` to be sure).

        Raises `NonFiniteError` (writing nothing) when a floating-point leaf of `state` holds NaN or inf.
        """
        bad = nonfinite_leaves(state)
        if bad:
            raise NonFiniteError(
                f"refusing to save checkpoint {step}: non-finite values in {', '.join(bad[:3])}"
                + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            )
        item = {"train": state, "key": jax.random.key_data(key)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)

    def restore(self, step: int, state_like: Any, key_like: jax.Array) -> tuple[Any, jax.Array, dict[str, Any]]:
        """Restore checkpoint `step` onto the structure, shapes, dtypes (and shardings) of `state_like`.

        A dataclass state (`TrainState`) restores field by field: a field the checkpoint does not hold (one added to
        the state since it was written, e.g. `value_params`) keeps `state_like`'s value, which must then be None.
        Returns (state, key, meta); `key_like` gives the key's implementation.
        """
        train = state_like
        if dataclasses.is_dataclass(state_like):
            saved = set(self._manager.item_metadata(step)["state"]["train"])
            fields = {f.name: getattr(state_like, f.name) for f in dataclasses.fields(state_like)}
            absent = [name for name, value in fields.items() if name not in saved and value is not None]
            if absent:
                raise ValueError(f"checkpoint {step} holds no {', '.join(absent)}")
            train = {name: value for name, value in fields.items() if name in saved}
        item = {"train": train, "key": jax.random.key_data(key_like)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, item)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        impl = jax.random.key_impl(key_like)
        key = jax.random.wrap_key_data(restored.state["key"], impl=impl)
        state = restored.state["train"]
        if dataclasses.is_dataclass(state_like):
            state = state_like.replace(**state) if hasattr(state_like, "replace") else dataclasses.replace(
                state_like, **state)
        return state, key, dict(restored.meta)

    def read_meta(self, step: int) -> dict[str, Any]:
        """Checkpoint `step`'s JSON meta alone (e.g. to check the run's layout before restoring the state)."""
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish any in-flight save and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
