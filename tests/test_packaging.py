"""The lock and the package's requirements agree, and the suite runs on the lock: constraints.txt pins every package
of the test environment (`make lock` writes it, `make run` / `make test` install with it); each base dependency's lower
bound in pyproject.toml is its locked version (the only one tested); TRL, ruff and torch are pinned to the lock; the
direct dependencies installed here are the locked versions."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
            assert m, f"constraints.txt: not `name==version`: {line!r}"
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_lock_pins_every_direct_dependency_once():
    pins = lock()
    assert len(pins) > 100  # the whole environment, not a few names
    direct = [Requirement(r) for r in project()["dependencies"] + project()["optional-dependencies"]["test"]]
    assert not [r.name for r in direct if canonicalize_name(r.name) not in pins]
    text = (ROOT / "constraints.txt").read_text()
    assert "+cpu" not in text  # torch's local label stripped: `torch==2.13.0` matches the CPU wheel and PyPI's


def test_base_lower_bounds_are_the_locked_versions():
    """`>=` the version the suite passed on: after `make lock` moves a package, raise its bound here too."""
    pins = lock()
    wrong = {}
    for req in map(Requirement, project()["dependencies"]):
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == ">=", f"{req}: one lower bound"
        if specs[0].version != pins[canonicalize_name(req.name)]:
            wrong[req.name] = (specs[0].version, pins[canonicalize_name(req.name)])
    assert not wrong, f"pyproject.toml lower bound vs constraints.txt: {wrong}"


def test_parity_and_lint_tools_are_pinned_to_the_lock():
    pins = lock()
    test_extra = {canonicalize_name(r.name): r for r in map(Requirement, project()["optional-dependencies"]["test"])}
    for name in ("trl", "ruff", "torch", "jax"):  # jax: `jax[tpu]==...`, libtpu at the package's jax
        specs = list(test_extra[name].specifier)
        assert [s.operator for s in specs] == ["=="], test_extra[name]
        assert specs[0].version == pins[name], (name, specs[0].version, pins[name])
    assert pins["trl"] == "1.16.0"  # the TRL the parity tests reproduce (tests/test_trl_options.py)
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("-c $(LOCK)") >= 4 and "LOCK    = constraints.txt" in makefile
    assert '--target .venv-trl112 "trl==1.12.0"' in makefile  # PPO parity: TRL 1.12.0's PPOTrainer


def test_the_suite_runs_on_the_locked_versions():
    """Every direct dependency installed here (base and test extra) is at its locked version, so the lower bounds
    above are what the suite checked. A different environment fails here: install it with `make install-test`."""
    pins = lock()
    names = [Requirement(r).name for r in project()["dependencies"] + project()["optional-dependencies"]["test"]]
    wrong = {}
    for name in names:
        installed = metadata.version(name).split("+")[0]
        if installed != pins[canonicalize_name(name)]:
            wrong[name] = (installed, pins[canonicalize_name(name)])
    assert not wrong, f"installed vs constraints.txt: {wrong}"


def test_chat_templates_work_on_the_base_install():
    """Conversational prompts (TRL's usual `prompt` column of messages, rloo_jax/data.py) and the tool demo render
    through `apply_chat_template`, which needs jinja2; transformers does not require it, so the base install must."""
    base = {canonicalize_name(Requirement(r).name) for r in project()["dependencies"]}
    assert "jinja2" in base
    transformers_needs = {canonicalize_name(Requirement(r).name) for r in metadata.requires("transformers") or []
                          if "extra ==" not in r}
    assert "jinja2" not in transformers_needs  # else this base dependency could go
