"""Where a run's batches live: one device, or a mesh over every process's devices; which rows each process
handles, and the collectives that bring them together."""

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rloo_jax.mesh import host_local_batch_to_global, local_rows, process_slice, replicate
from rloo_jax.rewards import RewardLogs


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where batches live: the default device (`mesh` None, one device) or a mesh over every process's devices.

    Each process handles the rows `rows(n)` of a global batch of `n` (all of them with one process); `to_global`
    turns its rows into a global array sharded over the mesh, `local` reads its rows of a global array back,
    `gather` gives every process all rows (a collective: every process must call it).
    """

    mesh: Mesh | None

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs, records, config.yaml and final/."""
        return jax.process_index() == 0

    @property
    def multi_process(self) -> bool:
        return jax.process_count() > 1

    def rows(self, n: int) -> slice:
        return slice(0, n) if self.mesh is None else process_slice(n)

    def to_global(self, local: np.ndarray) -> jax.Array:
        return jnp.asarray(local) if self.mesh is None else host_local_batch_to_global(local, self.mesh)

    def replicate(self, value: Any) -> Any:
        return value if self.mesh is None else replicate(value, self.mesh)

    def local(self, x: jax.Array) -> np.ndarray:
        return np.asarray(x) if self.mesh is None else local_rows(x)

    def gather(self, x: Any) -> np.ndarray:
        """All rows, on every process: of a global array, or of each process's own rows concatenated in order."""
        if not self.multi_process:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def gather_tree(self, tree: Any) -> Any:
        """A pytree of (sharded) global arrays -> the same pytree of whole numpy arrays, on every process."""
        if not self.multi_process:
            return jax.device_get(tree)
        return multihost_utils.process_allgather(tree, tiled=True)

    def per_process(self, values: Sequence[int]) -> np.ndarray:
        """[process_count, k] int32: every process's `values` ([1, k] with one process, no communication)."""
        mine = np.asarray(values, np.int32)[None]
        return self.gather(mine) if self.multi_process else mine

    def host_key(self, key: jax.Array) -> jax.Array:
        """A (replicated) global PRNG key -> the same key on this process's default device."""
        if self.mesh is None:
            return key
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key))

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (one process: `flag`)."""
        return bool(self.per_process([int(flag)]).max())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every process's JSON-ready `obj`, in process order, on every process (one process: `[obj]`)."""
        if not self.multi_process:
            return [obj]
        data = np.frombuffer(json.dumps(obj, default=lambda v: getattr(v, "tolist", lambda: str(v))()).encode(),
                             np.uint8)
        sizes = self.per_process([len(data)])[:, 0]
        padded = np.zeros((1, int(sizes.max())), np.uint8)
        padded[0, : len(data)] = data
        rows = self.gather(padded)
        return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes, strict=True)]

    def reward_logs(self, logs: RewardLogs, rows: int) -> tuple[dict[str, list[Any]], dict[str, float]]:
        """What the reward functions logged on every process, for this process's `rows` completions: (extra
        columns over all rows in global order, None where a process logged none; the mean of each metric over all
        processes' values, as TRL's gather). Every process must call it."""
        taken = self.gather_objects([*logs.take(), rows])
        columns = sorted({c for extra, _, _ in taken for c in extra})
        extra = {c: [v for e, _, n in taken for v in e.get(c, [None] * n)] for c in columns}
        sums: dict[str, list[float]] = {}
        for _, metrics, _ in taken:
            for name, (total, count) in metrics.items():
                acc = sums.setdefault(name, [0.0, 0])
                acc[0], acc[1] = acc[0] + total, acc[1] + count
        return extra, {name: total / count for name, (total, count) in sums.items() if count}
