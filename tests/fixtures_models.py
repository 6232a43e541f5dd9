"""Session fixture: tiny HF checkpoints from `tests/checkpoints.py`, built once per session on first use.

Use in a test module with `from tests.fixtures_models import tiny_checkpoint  # noqa: F401`, then
`def test_x(tiny_checkpoint): path = tiny_checkpoint("qwen2_tied")` (names: `checkpoints.BUILDERS`).
"""

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.checkpoints import BUILDERS


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get
