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


def test_files_run_longest_first_by_the_listed_seconds(tmp_path):
    """--file-seconds: whole files in the listed order, longest first, unlisted ones last (one worker takes them in
    the order xdist hands them out; without the list, xdist's own order puts test_c.py, the most tests, first)."""
    table = tmp_path / "seconds.txt"
    table.write_text("# comment\n   9.5s test_a.py (CPU 9.0s)\n 0.5s test_c.py\n")
    listed = run(tmp_path, "--file-seconds", str(table), "-vv", workers=1)
    assert listed.returncode == 0, listed.stdout[-3000:]
    order = [line.split("::")[0].split()[-1] for line in listed.stdout.splitlines() if "PASSED" in line]
    assert order == ["test_a.py", "test_c.py", "test_c.py", "test_c.py"], listed.stdout[-3000:]
    default = run(tmp_path, "-vv", workers=1)
    order = [line.split("::")[0].split()[-1] for line in default.stdout.splitlines() if "PASSED" in line]
    assert order[0] == "test_c.py", default.stdout[-3000:]


def test_the_listed_files_exist():
    """Every file tests/file_seconds.txt lists is a test file of the suite (a renamed file would lose its place)."""
    from tests.suite_checks import file_seconds

    listed = file_seconds()
    assert len(listed) >= 10 and all((ROOT / path).is_file() for path in listed), listed
