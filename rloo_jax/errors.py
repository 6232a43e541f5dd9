"""User-facing errors: raised for bad configuration or data, printed by the CLI as one line (exit code 2).

An error names the option to fix as its reader writes it: the command line's flag (`--num_generations`) when the
CLI is running (`command_line()`), else the Python argument (`num_generations`, as `RLOOConfig(num_generations=...)`
takes it). Messages are written with flags; a Python reader's copy has them rewritten once, when raised."""

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

_cli = False  # the process is running the command line (a global, not a context variable: threads raise too)
_FLAG = re.compile(r"(?<![\w-])--(?=[a-z])")


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Errors raised inside name command-line flags (the CLI's entry points)."""
    global _cli
    before, _cli = _cli, True
    try:
        yield
    finally:
        _cli = before


def for_reader(message: str) -> str:
    """`message` as its reader writes options: flags on the command line, argument names in Python.

    Example: "set --num_generations 2 or more" -> "set num_generations 2 or more" outside the CLI."""
    return message if _cli else _FLAG.sub("", message)


def assignments(values: dict[str, Any], flag_text: Callable[[Any], str] = str) -> str:
    """Options to set, as their reader writes them: `--seed 0 --beta 0.1` on the command line (each value as
    `flag_text` writes it), `seed=0, beta=0.1` in Python."""
    if _cli:
        return " ".join(f"--{k} {flag_text(v)}" for k, v in values.items())
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


class _Named(ValueError):
    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(for_reader(message) if isinstance(message, str) else message, *args)


class ConfigError(_Named):
    """A configuration value is invalid. The message names the option and how to fix it."""


class DataError(_Named):
    """The dataset cannot be used (missing, unreadable, empty, no `prompt` column, ...)."""


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable. The message names the function."""
