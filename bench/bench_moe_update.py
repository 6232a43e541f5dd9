"""The tiny Qwen3-MoE policy's rollout and update for a v5e-4 by the TPU compiler (`--compile_only`, libtpu, no
TPU): the compiler's FLOPs per chip over the model FLOPs of the active parameters (`x model`), and the decode
step's HBM bytes, for each `moe_implementation`, K 2 and 8 of 8 experts, and K 2 with `--expert_parallel 4`; with
the TPU's default attention (splash: at these 48-token rows its 128-wide blocks are mostly padding) and with eager.

    JAX_PLATFORMS=cpu python bench/bench_moe_update.py [routing]

The model and shapes are tests/test_expert_parallel.py's compile-only test's (D 64, 2 layers, 8 experts of 32; G 4,
batch 4, prompt 16, completion 32). `routing`: Qwen3-30B-A3B's routing (128 experts, 8 a token) in a small model
(D 512, 4 layers, experts of 256) over a micro-batch of 64 rows of 16 + 256 tokens (about 1,100 rows an expert), by
each implementation. BENCHMARKS.md Session 19 has the figures.
"""

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rloo_jax.cli import main  # noqa: E402
from tests.checkpoints import BUILDERS  # noqa: E402
from tests.test_compile_only import common, config_only_model  # noqa: E402
from tests.test_expert_parallel import TINY_QWEN3_MOE  # noqa: E402

RUNS = [(attention, impl, k, ep) for attention in ("splash", "eager") for impl in ("ragged_dot", "megablox")
        for k, ep in ((2, 1), (8, 1), (2, 4))]


ROUTING = dict(TINY_QWEN3_MOE, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=128, num_experts_per_tok=8)


def report(root: Path, implementation: str, k: int, expert_parallel: int, attention: str = "splash",
           config: dict | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One compile-only run's compile_report.json (`config`: the model's, default TINY_QWEN3_MOE with K `k`;
    `extra`: more options, the last of a name wins)."""
    tmp = root / f"{attention}_{implementation}_{k}_{expert_parallel}"
    tmp.mkdir()
    config = dict(TINY_QWEN3_MOE, num_experts_per_tok=k) if config is None else config
    model = config_only_model(tmp, config, BUILDERS["tokenizer"](root / "tok")
                              if not (root / "tok").exists() else root / "tok")
    argv = common(tmp, model) + ["--topology", "v5e-4", "--moe_implementation", implementation,
                                 "--expert_parallel", str(expert_parallel), "--attn_implementation", attention,
                                 *extra]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    assert code == 0, f"compile-only exited {code}"
    return json.loads((tmp / "out" / "compile_report.json").read_text())


if __name__ == "__main__":
    routing = sys.argv[1:] == ["routing"]
    runs = [("splash", impl, 8, 1) for impl in ("ragged_dot", "megablox")] if routing else RUNS
    extra = ("--per_device_train_batch_size", "64", "--max_completion_length", "256") if routing else ()
    with tempfile.TemporaryDirectory() as d:
        for attention, implementation, k, ep in runs:
            programs = report(Path(d), implementation, k, ep, attention, ROUTING if routing else None,
                              extra)["programs"]
            rollout, update = programs["rollout"], programs["update"]
            ratio = lambda p: f"{p['flops'] / 1e6:.1f}M / " + (  # noqa: E731
                "?" if p.get("model_flops") is None else f"{p['model_flops'] / 1e6:.1f}M = {p['flops_ratio']:.2f}x")
            decode, floor = (rollout.get(f"decode_{n}_bytes_per_step") or float("nan") for n in ("hbm", "floor"))
            print(f"{attention:6s} {implementation:10s} K {k} expert_parallel {ep}: rollout {ratio(rollout)}, "
                  f"update {ratio(update)}, decode step {decode / 1e6:.2f} MB (floor {floor / 1e6:.2f})", flush=True)
            if routing:
                print(json.dumps({n: {k: v for k, v in p.items() if k != "parts"} for n, p in programs.items()}))
