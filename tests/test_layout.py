"""The package's structure holds: no import cycles, every module imports only its own layer or the layers below
(docs/architecture.md draws them), and no algorithm is named outside `rloo_jax/algorithms/` and the two registries.

Read from the source (every `import` and `from ... import`, inside functions too), nothing is run."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rloo_jax"

# top to bottom; a module imports modules of its own layer or of lower ones. The last layer is every other module
# (the ground: models, sampling, log-probs, rewards, data, metrics, mesh, numerics, ...).
LAYERS: list[tuple[str, set[str]]] = [
    ("entries", {"rloo_jax.__main__", "rloo_jax.train", "rloo_jax.export"}),
    ("public API", {"rloo_jax"}),
    ("command line", {"rloo_jax.cli"}),
    ("trainers", {"rloo_jax.trainers"}),
    ("loop and compile-only", {"rloo_jax.loop", "rloo_jax.aot", "rloo_jax.evaluation", "rloo_jax.completions",
                               "rloo_jax.resume", "rloo_jax.conversations", "rloo_jax.external"}),
    ("assembly", {"rloo_jax.build"}),
    ("programs", {"rloo_jax.programs"}),
    ("step", {"rloo_jax.step"}),
    ("algorithms", {"rloo_jax.algorithms"}),  # the package: its math and configs
    ("base config", {"rloo_jax.config"}),
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (a name imported from a package that is a module of it: that
    module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rloo_jax")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rloo_jax"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return found - {name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(name: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if name in members or any(name.startswith(m + ".") for m in members if m != "rloo_jax"):
            return i
    return len(LAYERS)


def test_the_layers_are_read_from_the_source():
    g = graph()
    assert g["rloo_jax.cli"] >= {"rloo_jax.trainers", "rloo_jax.aot", "rloo_jax.algorithms"}
    assert "rloo_jax.models.lora" in g["rloo_jax.models.hf"]  # a name from a module (inside a function)
    assert layer("rloo_jax.algorithms.grpo_config") == layer("rloo_jax.algorithms") < layer("rloo_jax.config")
    assert layer("rloo_jax.mesh") == len(LAYERS)


def test_no_module_imports_a_higher_layer():
    upward = sorted((a, b) for a, targets in graph().items() for b in targets if layer(b) < layer(a))
    assert upward == [], "imports from a higher layer (docs/architecture.md): " + ", ".join(
        f"{a} -> {b}" for a, b in upward)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


# an algorithm's name as a string, or its config class: only inside algorithms/ and the two registries' files
NAMES = re.compile(r"""["'](rloo|grpo|ppo)["']|\b(RLOOConfig|GRPOConfig|PPOConfig)\b""")
# the trainers' registry (the configs' is algorithms/__init__.py); the public API, which re-exports the classes
ALLOWED = {"rloo_jax/trainers.py", "rloo_jax/__init__.py"}


def code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """The lines of `path` that are code, not docstrings or comments."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs |= set(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs |= set(range(node.lineno, node.end_lineno + 1))  # attribute docstrings
    lines = path.read_text().splitlines()
    return [(i, line.split("#")[0]) for i, line in enumerate(lines, 1) if i not in docs]


def test_no_algorithm_is_named_outside_the_algorithms():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("rloo_jax/algorithms/") or rel in ALLOWED:
            continue
        found += [f"{rel}:{i}: {line.strip()}" for i, line in code_lines(path) if NAMES.search(line)]
    assert found == [], "\n".join(found)
