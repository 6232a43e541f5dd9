"""A step's wall time split into phases where the host waits anyway, without making the loop wait."""

import queue
import threading
import time

import jax


class ReadyTime:
    """When an array's computation ends, taken by a watcher thread that blocks on it, so the loop itself never
    waits for it (`join()`: that time on the `time.perf_counter` clock; None for no array). One watcher thread
    per process serves every step (starting a thread per step cost ~0.2-0.5 ms here)."""

    _queue: "queue.SimpleQueue[ReadyTime]" = queue.SimpleQueue()
    _watcher: threading.Thread | None = None

    def __init__(self, x: jax.Array | None) -> None:
        self._x, self._done = x, threading.Event()
        self._seen = self._bound = float("inf")
        if x is None:
            return
        if ReadyTime._watcher is None:
            ReadyTime._watcher = threading.Thread(target=ReadyTime._watch, daemon=True, name="rloo_jax-ready-time")
            ReadyTime._watcher.start()
        ReadyTime._queue.put(self)

    @staticmethod
    def _watch() -> None:
        while True:
            item = ReadyTime._queue.get()
            try:
                item._x.block_until_ready()
            finally:  # a failed computation is reported by the loop's own read of its results
                item._seen = time.perf_counter()
                item._done.set()

    def done_by(self, t: float) -> None:
        """When the array is ready at time `t` (no wait), it ended by `t`: bounds the watcher's time, which lags
        while the loop's Python work holds the GIL."""
        if self._x is not None and self._x.is_ready():
            self._bound = t

    def join(self) -> float | None:
        if self._x is None:
            return None
        self._done.wait()
        self._x = None  # the watcher and this object no longer hold the array
        return min(self._seen, self._bound)


def phase_timings(start: float, sampled: float, rewarded: float, reference: float | None, updated: float
                  ) -> dict[str, float]:
    """A step's wall time split where the host waits anyway, summing to `updated - start`:

    sample = sampled - start (prompts encoded, the sampler run, its completion ids read back);
    reward = rewarded - sampled (decoding and the reward functions on the host, while the reference pass runs on
    the device); reference = max(0, reference - rewarded) (the part of the reference pass the rewards did not
    hide; 0 without one); update = updated - max(rewarded, reference) (the update(s), read back as the optimizer's
    skip counters). E.g. (0, 2, 5, 6, 9) -> sample 2, reward 3, reference 1, update 3; (0, 2, 5, 4, 9) -> 2, 3, 0, 4.
    """
    reference = sampled if reference is None else reference
    return {
        "timing/sample": sampled - start,
        "timing/reference": max(0.0, reference - rewarded),
        "timing/reward": rewarded - sampled,
        "timing/update": updated - max(rewarded, reference),
    }
