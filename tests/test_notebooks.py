"""The notebooks under notebooks/ run top to bottom offline, and are committed without outputs."""

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"inspect_rollouts.ipynb", "research_api.ipynb"}
KERNEL = "rloo-jax-test"


def test_expected_notebooks_exist():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: run scripts/strip_notebooks.py"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    """A kernelspec that starts this interpreter (the venv's python), with the repository importable and no
    network lookups, whatever `python3` kernelspec is installed on PATH."""
    from jupyter_client.kernelspec import KernelSpecManager

    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / KERNEL
    spec_dir.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rloo_jax (tests)",
        "language": "python",
        "env": {
            "PYTHONPATH": pythonpath,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
            "MPLBACKEND": "Agg",
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(root)])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_executes(name, tmp_path, kernel_spec_manager):
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=kernel_spec_manager)
    # temp files the notebook makes (e.g. the demo run of inspect_rollouts) land in tmp_path too
    km.kernel_spec.env["TMPDIR"] = str(tmp_path)
    client = NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code" and c.source.strip())
