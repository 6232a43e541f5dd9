"""Test-wide settings: no hub lookups (the network is closed), CPU jax unless asked for the accelerator, float32
matmuls in float32 on every backend, deterministic GPU programs, XLA:CPU's fast-compiling settings on the CPU
(tests/xla_flags.py), `cpu_only` tests skipped on an accelerator, a cache folder of the run's own, the run-wide checks
of tests/suite_checks.py."""

import ast
import functools
import gc
import os
import shutil
import tempfile
import threading

import pytest

# CPython 3.11.7 (this machine's) keeps the AST builder's recursion depth per interpreter, not per thread: an
# `ast.parse` in one thread (pytest importing a test module, traceback's caret anchors) while another thread is
# inside one, switched to by Python code run within a garbage collection (JAX's gc callback), fails with
# `SystemError: AST constructor recursion depth mismatch` (CI's runs of d954c37 and 41f954f). With collections paused,
# no Python code runs inside the builder, so no other thread does. Fixed in CPython 3.11.8; tests/test_conftest.py.
# `__wrapped__`: this file may be imported twice (by pytest as `conftest`, by a test as `tests.conftest`)
_ast_parse = getattr(ast.parse, "__wrapped__", ast.parse)


_parsing = threading.Lock()


@functools.wraps(_ast_parse)
def _parse_without_collections(*args, **kwargs):
    # parses in several threads at once: collections stay paused until the last one ends, and come back as the
    # first one found them (each parse restoring its own reading let one thread's end re-enable them mid-parse of
    # another, and a reading taken inside another's parse left them off)
    state = _parse_without_collections
    with _parsing:
        if state.in_flight == 0:
            state.enabled = gc.isenabled()
            gc.disable()
        state.in_flight += 1
    try:
        return _ast_parse(*args, **kwargs)
    finally:
        with _parsing:
            state.in_flight -= 1
            if state.in_flight == 0 and state.enabled:
                gc.enable()


_parse_without_collections.in_flight, _parse_without_collections.enabled = 0, True


ast.parse = _parse_without_collections

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rloo_jax's cache folder (the demo model and data; the JAX compilation cache of runs that keep it on), fresh for each
# test run instead of the user's ~/.cache/rloo_jax, so the suite's time and outcome do not depend on a warm home
# cache. Shared within the run: xdist workers and the CLI subprocesses inherit it (set before rloo_jax is imported).
# An RLOO_JAX_CACHE set outside is used as is.
_OWN_CACHE = None
if not os.environ.get("RLOO_JAX_CACHE"):
    _OWN_CACHE = os.environ["RLOO_JAX_CACHE"] = tempfile.mkdtemp(prefix="rloo_jax_test_cache_")
# One persistent compilation cache for the whole run, in its cache folder (what the CLI's --compilation_cache_dir
# defaults to there): the suite compiles the same tiny programs in many tests, in both xdist workers and in the CLI
# and worker subprocesses, which inherit these variables (so a run's --compilation_cache false leaves it on). A hit
# skips XLA's compile; tests that count compilations count hits too (tests/test_compile.py `count_compiles`).
for _name, _value in {"JAX_COMPILATION_CACHE_DIR": os.path.join(os.environ["RLOO_JAX_CACHE"], "jax_cache"),
                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}.items():
    os.environ.setdefault(_name, _value)
# `make test`: the CPU. `make test-accelerator` sets JAX_PLATFORMS empty: JAX picks the GPU or TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# GCS clients (gs:// tests against a local fake, tests/gcs.py) never look for credentials or probe a metadata
# server; gcsfs and google-auth read these once, at import
for _name, _value in {"FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                      "NO_GCE_CHECK": "true"}.items():
    os.environ.setdefault(_name, _value)

# XLA:CPU's compile flags as the CLI sets them (rloo_jax.backend.cpu_compile_flags), for the in-process tests as for
# the CLI subprocesses: the same flags, the same compilation cache keys; on the CPU the suite's own (tests/xla_flags.py)
from rloo_jax.backend import cpu_compile_flags  # noqa: E402  (after RLOO_JAX_CACHE: rloo_jax reads it at import)

cpu_compile_flags()
if os.environ["JAX_PLATFORMS"] == "cpu":
    from tests.xla_flags import compile_fast

    compile_fast()
else:
    from rloo_jax.numerics import enable_determinism

    enable_determinism()  # same-seed runs (in-process and the CLI subprocesses, which inherit XLA_FLAGS) agree

import jax  # noqa: E402

# The float32 tests assert float32 agreement (1e-6..1e-4: logits vs transformers, prefill vs decode, update = SGD,
# ...). JAX's default float32 matmul is TF32 on NVIDIA GPUs and one bfloat16 pass on TPUs (1e-3..2e-2 measured on
# an H100), so the suite computes them at `highest` (a no-op on XLA:CPU). Runs of the product (`train`, the CLI)
# set their own resolved matmul_precision and put this one back (rloo_jax.numerics).
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _suite_matmul_precision():
    """Every test starts at the suite's `highest`: a test that leaves another precision behind (CI's run of 4af8364:
    test_numerics found `default` after an earlier test of its worker) does not change its neighbours'."""
    yield
    if jax.config.jax_default_matmul_precision != "highest":
        jax.config.update("jax_default_matmul_precision", "highest")

# Session-scoped tiny offline checkpoints (built once per test session), usable from every test module.
pytest_plugins = ["tests.fixtures_models", "tests.suite_checks"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE is not None:  # the process that made it: the xdist controller, or the only process
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cpu_only")
    if marker is not None and jax.default_backend() != "cpu":
        pytest.skip(f"cpu_only: {marker.kwargs.get('reason') or (marker.args[0] if marker.args else '')}")
