"""Compile seconds per program of a `--compile_only` run, for one or more source trees, alternating rounds.

Each round runs `python -m rloo_jax.train --compile_only` (bench_fit.py's SETTINGS, Llama-3.1-8B on a v5p-8 by
default) in a fresh process per tree, with that tree first on PYTHONPATH (a `git worktree` of another commit:
compare commits on one machine, in the same rounds), and prints per program its compile seconds (trace + lower +
the TPU compiler) and the size of the optimized program in HLO instructions, with the machine's load average and
the run's wall and CPU seconds. Compile seconds follow the host's load (BENCHMARKS.md: ~10x on this 2-core machine
under a load of 10); the instruction counts do not, so a program that grew shows there whatever the load. The counts are
taken in the child process from the compiled text that `rloo_jax.aot.compile_program` hands to `hlo.analyze`, so
trees older than the report's own `hlo_instructions` field give them too.

    git worktree add /tmp/wt-old 955f001
    .venv/bin/python bench/bench_compile_time.py --trees /tmp/wt-old . [--rounds 2] [--model Llama-3.1-8B]
        [--slice v5p-8] [--args "--completion_bucket 0"] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_fit import SETTINGS  # noqa: E402
from fit_models import write_model  # noqa: E402

# in the child: count each compiled program's HLO instructions as aot hands its text to hlo.analyze, then the CLI
DRIVER = """
import json, re, sys
import rloo_jax.aot as aot, rloo_jax.hlo as hlo
sizes, name, analyze, compile_program = {}, [None], hlo.analyze, aot.compile_program
def counted(text):
    sizes[name[0]] = sum(1 for line in text.splitlines() if re.match(r"\\s*(ROOT )?%\\S+ = ", line))
    return analyze(text)
def named(program, *args, **kwargs):
    name[0] = program
    return compile_program(program, *args, **kwargs)
hlo.analyze, aot.compile_program = counted, named
sys.argv = ["rloo_jax.train", *sys.argv[1:]]
try:
    from rloo_jax.cli import main
except ImportError:  # trees before rloo_jax/cli.py
    from rloo_jax.train import main
try:
    code = main()
except SystemExit as e:
    code = e.code
with open(SIZES, "w") as f:
    json.dump(sizes, f)
sys.exit(code)
"""


def run(tree: Path, model_dir: Path, data: Path, slice_name: str, extra: list[str], root: Path) -> dict:
    out, sizes = root / "out", root / "sizes.json"
    argv = ["--compile_only", "--topology", slice_name, "--model_name_or_path", str(model_dir), "--dataset_name",
            str(data), "--output_dir", str(out), *SETTINGS, *extra]
    code = f"SIZES = {str(sizes)!r}\n" + DRIVER
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load = os.getloadavg()
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=tree, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)  # the child's CPU seconds: less load-bound
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    report = json.loads((out / "compile_report.json").read_text())
    seconds = {n: p["compile_seconds"] for n, p in report["programs"].items()}
    if "rollout_reshard" in report:
        seconds["rollout_layout"] = report["rollout_reshard"]["compile_seconds"]
    counts = json.loads(sizes.read_text())  # a program the compiler refused (does not fit) has none
    return {"tree": str(tree), "commit": _commit(tree), "wall_seconds": wall, "cpu_seconds": cpu, "load_before": load,
            "load_after": os.getloadavg(), "compile_seconds": seconds, "hlo_instructions": counts}


def _commit(tree: Path) -> str:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--slice", default="v5p-8")
    ap.add_argument("--args", default="", help="extra trainer options")
    ap.add_argument("--json", help="also write every run to this JSON file")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "prompts.jsonl"
        data.write_text('{"prompt": "w1 w2 w3"}\n')
        model_dir = write_model(root, args.model)
        for r in range(args.rounds):
            for tree in args.trees:
                res = run(tree.resolve(), model_dir, data, args.slice, shlex.split(args.args), root)
                runs.append(dict(res, round=r))
                cells = " ".join(f"{n} {s:.0f} s ({res['hlo_instructions'].get(n, '?')} instr)"
                                 for n, s in res["compile_seconds"].items())
                print(f"round {r} {res['commit']}: whole run {res['wall_seconds']:.0f} s "
                      f"({res['cpu_seconds']:.0f} CPU s), load "
                      f"{res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}: {cells}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
