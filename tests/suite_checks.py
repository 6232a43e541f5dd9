"""Checks on the run as a whole (a pytest plugin, loaded by tests/conftest.py).

- `--expect-skips tests/expected_skips.txt` (`make test` on the whole suite, hence CI): the run fails unless the tests
  that skipped are exactly those listed there (a missing `.venv-trl112`, TRL or torch would otherwise skip dozens of
  parity tests silently). A subset run (`make test PYTEST_ARGS=...`) does not check.
- `--durations-by-file N`: the N test files that took longest (the sum of their tests' setup, call and teardown), after
  pytest's own `--durations` list, each with the CPU seconds it used (its worker process's and those of the
  subprocesses it waited for): wall time moves with the machine's load, CPU time much less. What to split or
  reschedule when the suite grows.
- `--file-seconds tests/file_seconds.txt` (`make test`): the test files run longest first, by the seconds listed there
  (unlisted files last, in collection order). xdist's `--dist loadfile` hands whole files to the workers in that order
  (its own reorder, by each file's count of tests, is turned off), so the files that start last are short ones and
  neither worker idles long at the end (CI's runs: 80-90 s of the suite's wall time, before).
"""

from __future__ import annotations

import re
import resource
from collections import defaultdict
from pathlib import Path

import pytest

EXPECTED_SKIPS = Path(__file__).with_name("expected_skips.txt")
FILE_SECONDS = Path(__file__).with_name("file_seconds.txt")

_skipped: dict[str, str] = {}
_by_file: dict[str, float] = defaultdict(float)
_cpu_by_file: dict[str, float] = defaultdict(float)
_cpu_start: dict[str, float] = {}
CPU = "cpu_seconds"  # the user property a test's last report carries to the xdist controller


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rloo_jax suite")
    group.addoption("--expect-skips", default=None, metavar="FILE",
                    help=f"fail unless the skipped tests are exactly those listed in FILE ({EXPECTED_SKIPS.name})")
    group.addoption("--durations-by-file", type=int, default=0, metavar="N",
                    help="list the N test files that took longest")
    group.addoption("--file-seconds", default=None, metavar="FILE",
                    help=f"run the test files longest first, by the seconds FILE lists ({FILE_SECONDS.name})")


def expected_skips(path: Path = EXPECTED_SKIPS) -> dict[str, str]:
    """{node id: why} from tests/expected_skips.txt (`node id  # why` a line; blank lines and # comments skipped)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        nodeid, _, why = line.partition("#")
        if nodeid.strip():
            out[nodeid.strip()] = why.strip()
    return out


def file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    """{test file: seconds} from tests/file_seconds.txt, whose lines are `--durations-by-file`'s (`  321.6s
    tests/test_x.py (CPU 304.2s)`; what follows the path is ignored); blank lines and # comments skipped."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*([0-9.]+)s?\s+(\S+)", line.partition("#")[0])
        if m:
            out[m.group(2)] = float(m.group(1))
    return out


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--file-seconds") and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist hands out the files in the collection's order: ours


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = config.getoption("--file-seconds")
    if listed:  # a stable sort: each file's tests stay together, in their order
        seconds = file_seconds(Path(listed))
        items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a whole module skipped (pytest.importorskip at module level)
        _skipped[report.nodeid] = _reason(report)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _cpu_start[item.nodeid] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    if call.when == "teardown" and item.nodeid in _cpu_start:
        outcome.get_result().user_properties.append((CPU, cpu_seconds() - _cpu_start.pop(item.nodeid)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _by_file[path] += report.duration
    _cpu_by_file[path] += sum(v for k, v in report.user_properties if k == CPU)
    if report.skipped:
        _skipped[report.nodeid] = _reason(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sees every worker's reports
        return
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    n = config.getoption("--durations-by-file")
    if n and terminal is not None and _by_file:
        terminal.write_sep("=", f"slowest {n} test files (setup + call + teardown of their tests)")
        for path, seconds in sorted(_by_file.items(), key=lambda kv: -kv[1])[:n]:
            terminal.write_line(f"{seconds:8.1f}s {path} (CPU {_cpu_by_file[path]:.1f}s)")
        terminal.write_line(f"{sum(_by_file.values()):8.1f}s all {len(_by_file)} files "
                            f"(CPU {sum(_cpu_by_file.values()):.1f}s)")
    listed = config.getoption("--expect-skips")
    if not listed or session.exitstatus not in (0, 1):  # 2 and up: interrupted, usage error, ...
        return
    expected, name = expected_skips(Path(listed)), Path(listed).name
    unexpected = {k: v for k, v in _skipped.items() if k not in expected}
    missing = sorted(set(expected) - set(_skipped))
    if not unexpected and not missing:
        if terminal is not None:
            terminal.write_line(f"skips as expected: the {len(expected)} listed in {name}")
        return
    lines = [f"skipped, not listed in {name}: {k} ({v})" for k, v in sorted(unexpected.items())]
    lines += [f"listed in {name}, did not skip: {k} ({expected[k]})" for k in missing]
    if terminal is not None:
        terminal.write_sep("=", "unexpected skips (--expect-skips): the run fails", red=True)
        for line in lines:
            terminal.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
