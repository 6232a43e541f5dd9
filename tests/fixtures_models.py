"""Session fixtures: tiny HF checkpoints from `tests/checkpoints.py`, built once per session on first use; the
tool-calling demo policy, built once per run.

Use in a test module with `from tests.fixtures_models import tiny_checkpoint  # noqa: F401`, then
`def test_x(tiny_checkpoint): path = tiny_checkpoint("qwen2_tied")` (names: `checkpoints.BUILDERS`).
"""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.checkpoints import BUILDERS
from tests.xla_flags import xla_defaults


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tools_policy() -> str:
    """The tool-calling demo policy (rloo_jax.demo_tools) as a user's first run builds it: at XLA's defaults (its SFT
    runs 2.5x slower at the suite's compile settings), in the run's cache folder, once for both workers (the second
    waits on the build's lock)."""
    code = "from rloo_jax import demo_tools; print(demo_tools.model_folder())"
    r = subprocess.run([sys.executable, "-c", code], env=xla_defaults(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]
