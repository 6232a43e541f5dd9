"""rloo_jax vs TRL 1.16 `RLOOTrainer` (`use_vllm=False`) on one GPU: seconds per step and peak GPU memory.

The same random-init Qwen2.5-shaped checkpoints for both (0.5B and 1.5B, built here with transformers from their
public `config.json` values; float32 weights, bf16 compute), a 151,936-entry word-level tokenizer built offline with
`tokenizers`, 256 plain-text prompts of 96-128 tokens, G=8, 64 completions per optimizer step (16 per micro-batch,
4 micro-batches), 256 new tokens, beta 0.04 (a reference model), lr 1e-6 constant, a Python reward (distinct words),
6 steps; gradient checkpointing off and on for both. Per run: the warm mean s/step (steps 2-6; TRL's from a
callback at each optimizer step, ours from `step_time` in metrics.jsonl), the first step (our compile), our phase
times (`timing/*` in metrics.jsonl, when the trainer logs them) and the peak GPU memory, polled the same way for
both (`nvidia-smi` every 0.2 s in a thread of this process, minus what was in use before the run; JAX with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`). Each run is its own process; an out-of-memory run is reported as such. It
prints one markdown table and writes it into BENCHMARKS.md between the `bench_gpu` markers (`--no_write`: not).

    python bench/bench_gpu.py [--sizes 0.5B 1.5B] [--gradient_checkpointing off on] [--frameworks rloo_jax trl]
                              [--steps 6] [--tiny] [--benchmarks BENCHMARKS.md] [--no_write]

`--tiny` runs the whole script at a tiny size (hidden 64, 2 layers, vocab 2048, 16 completions per step, 16 new
tokens, 3 steps) so it can be checked end to end on a CPU, where the memory column says nvidia-smi is absent.

A fresh GPU machine, packages from the registry only (no hub is contacted: the models and tokenizer are built
here; `HF_HUB_OFFLINE=1`):

    python -m venv .venv && . .venv/bin/activate
    pip install -e . "jax[cuda12]==<the jax version in pyproject>" torch "trl==1.16.*" datasets
    python bench/bench_gpu.py

Offline (no registry on the GPU machine): on a machine with the same OS and Python, download the wheels, copy the
folder over, install from it alone:

    pip download -d wheels . "jax[cuda12]==<version>" torch "trl==1.16.*" datasets
    pip install --no-index --find-links wheels -e . "jax[cuda12]==<version>" torch "trl==1.16.*" datasets
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False, vocab_size=151936,
             tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643)
SIZES = {  # the public checkpoints' config.json values (bench/fit_models.py)
    "0.5B": dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(_QWEN, vocab_size=2048, bos_token_id=2047, eos_token_id=2047, pad_token_id=2047, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
# (completions per micro-batch, micro-batches per step, new tokens, prompt lengths, steps); G = 8 for both
WORK = {"full": (16, 4, 256, (96, 128), 6), "tiny": (8, 2, 16, (12, 16), 3)}
MARK_BEGIN, MARK_END = "<!-- bench_gpu:begin -->", "<!-- bench_gpu:end -->"


# ------------------------------------------------------------------------------------------------ assets
def build_checkpoint(root: Path, size: str) -> Path:
    """A random-init Qwen2 checkpoint (float32 safetensors, seed 0) with a word-level tokenizer whose vocabulary
    is the model's (w0 ... and `<|endoftext|>` at the EOS id, which is also the pad), all built offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    cfg = SIZES[size]
    out = root / f"qwen2.5-{size}"
    eos = cfg["eos_token_id"]
    vocab = {f"w{i}": i for i in range(cfg["vocab_size"]) if i != eos} | {"<|endoftext|>": eos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            padding_side="left").save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


def write_prompts(path: Path, vocab: int, lengths: tuple[int, int], count: int = 256) -> Path:
    """`count` plain-text prompts of random words, lengths[0]..lengths[1] tokens each (seed 0)."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            n = rng.randint(*lengths)
            f.write(json.dumps({"prompt": " ".join(f"w{rng.randint(1, vocab - 2)}" for _ in range(n))}) + "\n")
    return path


def reward(prompts, completions, **kwargs):  # noqa: ANN001, ANN003, ANN201 - TRL's and our reward signature
    """Fraction of distinct words in each completion (cheap, the same Python function for both)."""
    return [len(set(c.split())) / max(len(c.split()), 1) for c in completions]


# ------------------------------------------------------------------------------------------------ memory
class GpuMemoryPeak:
    """Polls `nvidia-smi --query-gpu=memory.used` (MiB, GPU 0) every `interval` s in a thread: the peak over a
    run minus the use before it. `available` is False where nvidia-smi is absent or fails (e.g. a CPU)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.available = self._read() is not None
        self.base = self._read() or 0
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def _read() -> int | None:
        if shutil.which("nvidia-smi") is None:
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10)
            return int(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = self._read()
            if used is not None:
                self.peak = max(self.peak, used)
            self._stop.wait(self.interval)

    def __enter__(self) -> GpuMemoryPeak:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    @property
    def peak_gib(self) -> float:
        return (self.peak - self.base) / 1024 if self.available else math.nan


# ------------------------------------------------------------------------------------------------ the two runs
def _settings(size: str) -> dict:
    per_device, micro, new_tokens, _, _ = WORK["tiny" if size == "tiny" else "full"]
    return dict(num_generations=8, per_device_train_batch_size=per_device, gradient_accumulation_steps=micro,
                max_completion_length=new_tokens, beta=0.04, learning_rate=1e-6, temperature=1.0, logging_steps=1,
                lr_scheduler_type="constant", seed=0)


def ours_command(model: Path, data: Path, out: Path, size: str, steps: int, gc: bool) -> list[str]:
    cmd = [sys.executable, "-m", "rloo_jax.train", "--model_name_or_path", str(model), "--dataset_name", str(data),
           "--reward_funcs", "bench_gpu:reward", "--output_dir", str(out), "--max_steps", str(steps),
           "--save_steps", str(10 * steps), "--bf16", "true", "--gradient_checkpointing", str(gc).lower(),
           "--max_prompt_length", "128", "--prompt_bucket", "32", "--report_to", "none"]
    for k, v in _settings(size).items():
        cmd += [f"--{k}", str(v)]
    return cmd


TRL_SCRIPT = r"""
import json, sys, time, torch
sys.path.insert(0, {here!r})
from datasets import load_dataset
from transformers import PreTrainedTokenizerFast, TrainerCallback
import trl
from bench_gpu import reward, _settings
# AutoTokenizer could rebuild it as Qwen2Tokenizer (another pre-tokenizer): load it as saved
tok = PreTrainedTokenizerFast.from_pretrained({model!r}, padding_side="left")
ds = load_dataset("json", data_files={data!r}, split="train")
times = []
class Timer(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
cuda = torch.cuda.is_available()
args = trl.RLOOConfig(output_dir={out!r}, max_steps={steps}, report_to=[], bf16=True, use_cpu=not cuda,
                      save_strategy="no", gradient_checkpointing={gc}, use_vllm=False,
                      model_init_kwargs=dict(dtype=torch.float32), **_settings({size!r}))
tr = trl.RLOOTrainer(model={model!r}, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
tr.add_callback(Timer())
tr.train()
print("RESULT", json.dumps({{"times": times,
                             "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}}))
"""

_OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OutOfMemory", re.IGNORECASE)


def _run(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    with GpuMemoryPeak() as mem:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, mem.peak_gib


def _failed(name: str, proc: subprocess.CompletedProcess) -> dict:
    text = proc.stdout[-4000:] + proc.stderr[-4000:]
    if _OOM.search(text):
        return {"error": "out of memory"}
    raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{text}")


def run_ours(model: Path, data: Path, size: str, steps: int, gc: bool, env: dict) -> dict:
    """`python -m rloo_jax.train` in a fresh process: step times and `timing/*` from its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as out:
        proc, peak = _run(ours_command(model, data, Path(out), size, steps, gc), env)
        if proc.returncode:
            return _failed("rloo_jax", proc) | {"peak_gib": peak}
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
    rows = [r for r in rows if "step_time" in r and "reward" in r]
    warm = rows[1:]
    phases = sorted({k for r in warm for k in r if k.startswith("timing/")})
    return {"first_s": rows[0]["step_time"], "step_s": _mean([r["step_time"] for r in warm]), "peak_gib": peak,
            "phases": {k: _mean([r[k] for r in warm if k in r]) for k in phases}}


def run_trl(model: Path, data: Path, size: str, steps: int, gc: bool, env: dict) -> dict:
    """TRL's RLOOTrainer in a fresh process; step times from a callback at each optimizer step."""
    with tempfile.TemporaryDirectory() as out:
        script = TRL_SCRIPT.format(here=str(HERE), model=str(model), data=str(data), out=out, steps=steps, gc=gc,
                                   size=size)
        proc, peak = _run([sys.executable, "-c", script], env)
    if proc.returncode:
        return _failed("TRL", proc) | {"peak_gib": peak}
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    times = result["times"]
    return {"first_s": times[0], "step_s": _mean(times[1:]), "peak_gib": peak,
            "torch_peak_gib": result["torch_peak_gib"]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


# ------------------------------------------------------------------------------------------------ the table
def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(results: list[dict], device: str, memory_note: str) -> str:
    """One markdown table: a row per (size, gradient checkpointing, framework)."""
    phase_names = sorted({k for r in results for k in r.get("phases", {})})
    short = [k.removeprefix("timing/") for k in phase_names]
    head = ["model", "gradient ckpt", "framework", "s/step (warm)", "first step s", "peak GiB (nvidia-smi)",
            *[f"{s} s" for s in short], "TRL / ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key = {(r["size"], r["gc"], r["framework"]): r for r in results}
    for r in results:
        if "error" in r:
            cells = [r["error"], "-", _num(r.get("peak_gib"), ".1f") + " (at failure)"]
        else:
            cells = [_num(r["step_s"], ".2f"), _num(r["first_s"], ".1f"), _num(r["peak_gib"], ".1f")]
        phases = [_num(r.get("phases", {}).get(k), ".2f") for k in phase_names]
        ratio = "-"
        other = by_key.get((r["size"], r["gc"], "TRL"))
        if r["framework"] == "rloo_jax" and other and "step_s" in other and "step_s" in r:
            ratio = f"{other['step_s'] / r['step_s']:.1f}x"
        lines.append("| " + " | ".join([r["size"], "on" if r["gc"] else "off", r["framework"], *cells, *phases,
                                        ratio]) + " |")
    lines.append("")
    lines.append(f"Device: {device}. {memory_note}")
    return "\n".join(lines)


def write_benchmarks(path: Path, text: str, command: str) -> None:
    """Replace the section between the bench_gpu markers of BENCHMARKS.md (appended the first time)."""
    body = f"{MARK_BEGIN}\n`{command}`\n\n{text}\n{MARK_END}"
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if MARK_BEGIN in old and MARK_END in old:
        new = old[: old.index(MARK_BEGIN)] + body + old[old.index(MARK_END) + len(MARK_END):]
    else:
        new = old.rstrip("\n") + "\n\n## GPU: rloo_jax vs TRL (`bench/bench_gpu.py`)\n\n" + body + "\n"
    path.write_text(new, encoding="utf-8")


def device_name() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return "one " + out.stdout.strip().splitlines()[0]
    return f"CPU ({os.cpu_count()} cores; no nvidia-smi)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["0.5B", "1.5B"], choices=["0.5B", "1.5B"])
    ap.add_argument("--gradient_checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--frameworks", nargs="+", default=["rloo_jax", "trl"], choices=["rloo_jax", "trl"])
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 6; --tiny 3); warm = all but the first")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the script end to end on CPU")
    ap.add_argument("--benchmarks", default=str(ROOT / "BENCHMARKS.md"), help="the file the table is written into")
    ap.add_argument("--no_write", action="store_true", help="print the table only")
    args = ap.parse_args()
    sizes = ["tiny"] if args.tiny else args.sizes
    steps = args.steps or WORK["tiny" if args.tiny else "full"][4]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            print(f"building the {size} checkpoint ...", flush=True)
            model = build_checkpoint(Path(root), size)
            data = write_prompts(Path(root) / f"prompts-{size}.jsonl", SIZES[size]["vocab_size"],
                                 WORK["tiny" if size == "tiny" else "full"][3])
            for gc in (g == "on" for g in args.gradient_checkpointing):
                for framework in args.frameworks:
                    run = run_ours if framework == "rloo_jax" else run_trl
                    print(f"{size} gradient checkpointing {'on' if gc else 'off'}: {framework} ...", flush=True)
                    r = run(model, data, size, steps, gc, env)
                    results.append(r | {"size": size, "gc": gc, "framework": "TRL" if framework == "trl" else
                                        "rloo_jax"})
                    print(json.dumps(results[-1]), flush=True)
    available = GpuMemoryPeak().available
    per_device, micro, new_tokens, lengths, _ = WORK["tiny" if args.tiny else "full"]
    note = (f"Qwen2.5-shaped random-init checkpoints, G=8, {per_device * micro} completions per step ({micro} "
            f"micro-batches of {per_device}), {new_tokens} new tokens, prompts {lengths[0]}-{lengths[1]} tokens, "
            f"beta 0.04, lr 1e-6, bf16, {steps} steps (warm: steps 2-{steps}). Peak memory: ")
    note += ("nvidia-smi's memory.used polled every 0.2 s, minus the use before the run (JAX without "
             "preallocation)." if available else "nvidia-smi is absent here: no GPU memory measured ('-').")
    text = table(results, device_name(), note)
    print(text)
    if not args.no_write:
        write_benchmarks(Path(args.benchmarks), text, "python bench/bench_gpu.py " + " ".join(sys.argv[1:]))
        print(f"written into {args.benchmarks}")


if __name__ == "__main__":
    main()
