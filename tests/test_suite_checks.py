"""The run-wide checks `make test` relies on (tests/suite_checks.py), each run on a small suite of its own in a pytest
subprocess, with two xdist workers as `make test` runs them (or one process)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = {
    "test_a.py": """
import pytest, time
def test_runs():  # 0.3 s of CPU
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
@pytest.mark.skip(reason="by design")
def test_skips(): pass
""",
    "test_b.py": """
import pytest
pytest.importorskip("a_module_that_is_not_installed")
def test_never(): pass
""",
    "test_c.py": """
import pytest
@pytest.mark.parametrize("i", range(3))
def test_param(i): pass
""",
}


def run(tmp_path: Path, *args: str, workers: int = 2, plugins: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """pytest on SUITE (in tmp_path) with the plugins, on `workers` xdist workers (0: one process)."""
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    loaded = [a for p in (*plugins, "tests.suite_checks", "no:cacheprovider") for a in ("-p", p)]
    return subprocess.run([sys.executable, "-m", "pytest", *loaded, "-q", "-n", str(workers), "--dist", "loadfile",
                           "--rootdir", str(tmp_path), *args, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def expected(tmp_path: Path, *nodeids: str) -> str:
    path = tmp_path / "expected.txt"
    path.write_text("# comment\n\n" + "".join(f"{n}  # why\n" for n in nodeids))
    return str(path)


def test_the_run_fails_unless_the_skips_are_exactly_the_listed_ones(tmp_path):
    both = expected(tmp_path, "test_a.py::test_skips", "test_b.py")
    ok = run(tmp_path, "--expect-skips", both)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "skips as expected: the 2 listed in expected.txt" in ok.stdout
    # a skip nobody listed (a module skipped whole: a missing package), and a listed test that did not skip
    unlisted = run(tmp_path, "--expect-skips", expected(tmp_path, "test_a.py::test_skips"))
    assert unlisted.returncode == 1 and "skipped, not listed in expected.txt: test_b.py" in unlisted.stdout
    missing = run(tmp_path, "--expect-skips", expected(tmp_path, *["test_a.py::test_skips", "test_b.py",
                                                                  "test_c.py::test_param[1]"]), workers=0)
    assert missing.returncode == 1, missing.stdout[-3000:]
    assert "listed in expected.txt, did not skip: test_c.py::test_param[1]" in missing.stdout


def test_slowest_files_are_listed(tmp_path):
    out = run(tmp_path, "--durations-by-file", "2", workers=0)  # and without --expect-skips, no check
    assert out.returncode == 0, out.stdout[-3000:]
    lines = out.stdout.split("slowest 2 test files")[1].splitlines()[1:3]
    assert " test_a.py (CPU " in lines[0] and float(lines[0].split("s ")[0]) >= 0.3
    assert float(lines[0].split("(CPU ")[1].rstrip("s)")) >= 0.3
