"""Strip outputs, execution counts and run metadata from notebooks before committing them.

    python scripts/strip_notebooks.py                 # every notebooks/*.ipynb, in place
    python scripts/strip_notebooks.py a.ipynb b.ipynb
    python scripts/strip_notebooks.py --check         # exit 1 listing notebooks that still carry outputs

Cell tags (e.g. `parameters`) are kept; the notebook's kernelspec is reset to the generic `python3`.
"""

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def strip(nb: nbformat.NotebookNode) -> bool:
    """Strip `nb` in place; returns whether anything changed."""
    before = nbformat.writes(nb)
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    return nbformat.writes(nb) != before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook needs it")
    args = parser.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if strip(nb):
            dirty.append(path)
            if not args.check:
                nbformat.validate(nb)
                nbformat.write(nb, path)
    for path in dirty:
        print(f"{'needs stripping' if args.check else 'stripped'}: {path}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
