"""Multi-turn tool-calling rollouts: ours (rloo_jax.conversations: each row's KV cache kept between turns, only the
tool results prefilled) vs TRL 1.16's GRPOTrainer tool loop (`_generate`: every turn re-generates from prompt +
completion + tool tokens), on the same policy, prompts and tools, greedy, on CPU.

The policy is the demo's tool-calling model (rloo_jax.demo_tools, built once under the demo cache). The prompts are
`add a b then multiply by 3`: each rollout makes 3 assistant turns (2 tool rounds: add, then multiply). G = 8.
Reports, per rollout batch, the tokens each side prefills (TRL: every generate call's input tokens; ours: each prompt
once for its G rows plus the tool-result tokens) and the wall seconds (median of alternating runs, with the range,
after one warm-up each: our programs compile on the first).

    python bench/bench_tools.py --prompts 2 --generations 8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max_completion_length", type=int, default=128)
    args = parser.parse_args(argv)

    import datasets
    import jax
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rloo_jax as rj
    from rloo_jax import demo_tools
    from rloo_jax.conversations import run_conversations
    from rloo_jax.loop import setup

    model = demo_tools.model_folder()
    rng = random.Random(0)
    rows = [{"prompt": demo_tools.conversation("chain", rng.randint(2, 9), rng.randint(2, 9), rng)[:1]}
            for _ in range(args.prompts)]
    g, n = args.generations, args.prompts * args.generations

    def tokenizer():
        tok = AutoTokenizer.from_pretrained(model)
        tok.response_template = demo_tools.QWEN3_RESPONSE_TEMPLATE
        return tok

    common = dict(per_device_train_batch_size=n, num_generations=g, max_completion_length=args.max_completion_length,
                  top_k=1, temperature=1.0, max_steps=1, report_to=[], bf16=False, shuffle_dataset=False)
    reward = demo_tools.answer_reward

    # ours: the trainer's own session (programs, state, tool use), one generation batch of conversations
    ours = rj.GRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions),
                          args=rj.GRPOConfig(output_dir="/tmp/bench_tools_ours", compilation_cache=False, **{
                              k: v for k, v in common.items() if k != "report_to"}),
                          processing_class=tokenizer(), train_dataset=datasets.Dataset.from_list(rows),
                                  tools=demo_tools.TOOLS)
    session = setup(ours.args, ours.given)
    batch = {"prompt": [r["prompt"] for r in rows]}
    key = jax.random.key(0)

    def run_ours() -> tuple[float, int, float]:
        t0 = time.perf_counter()
        conv = run_conversations(session.programs, session.state, batch, key, session.prepared.tool_use,
                                 session.prepared.encoder)
        jax.block_until_ready(conv.rollout.completion_ids)
        return time.perf_counter() - t0, conv.prefilled, float(conv.turns.mean())

    # TRL: its tool loop (`_generate`) on the same prompts, each repeated G times as its sampler repeats them
    torch.manual_seed(0)
    trl_trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                  reward_funcs=[reward], args=trl.GRPOConfig(output_dir="/tmp/bench_tools_trl",
                                                                             use_cpu=True, **common),
                                  processing_class=tokenizer(), train_dataset=datasets.Dataset.from_list(rows),
                                  tools=demo_tools.TOOLS)
    trl_trainer.model.eval()
    prefilled = [0]
    single_turn = trl_trainer._generate_single_turn

    def counted(prompt_ids, *a, **kw):
        prefilled[0] += sum(len(ids) for ids in prompt_ids)
        return single_turn(prompt_ids, *a, **kw)

    trl_trainer._generate_single_turn = counted
    tools = {t.__name__: t for t in demo_tools.TOOLS}

    def run_trl() -> tuple[float, int, float]:
        import copy

        prompts = [copy.deepcopy(r["prompt"]) for r in rows for _ in range(g)]
        trl_trainer._sync_tool_dicts = [dict(tools) for _ in range(n)]
        trl_trainer._async_tool_dicts = [{} for _ in range(n)]
        prefilled[0] = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = trl_trainer._generate(prompts)
        completions = out[3]
        turns = statistics.mean(sum(m["role"] == "assistant" for m in c) for c in completions)
        return time.perf_counter() - t0, prefilled[0], turns

    run_ours(), run_trl()  # warm-up: our programs compile, torch allocates
    times: dict[str, list[float]] = {"ours": [], "trl": []}
    counts, turns = {}, {}
    for _ in range(args.repeats):  # alternating
        for name, fn in (("ours", run_ours), ("trl", run_trl)):
            seconds, counts[name], turns[name] = fn()
            times[name].append(seconds)
    print(f"G {g}, {args.prompts} prompts ({n} rollouts), assistant turns per rollout: ours {turns['ours']:.2f}, "
          f"TRL {turns['trl']:.2f}")
    for name in ("ours", "trl"):
        t = times[name]
        print(f"{name:5s} prefilled tokens per rollout batch {counts[name]:6d} ({counts[name] / n:.1f} per rollout) | "
              f"wall s median {statistics.median(t):.3f} (range {min(t):.3f}-{max(t):.3f}, {len(t)} runs)")
    print(f"TRL / ours: prefilled {counts['trl'] / counts['ours']:.2f}x, "
          f"wall {statistics.median(times['trl']) / statistics.median(times['ours']):.2f}x")


if __name__ == "__main__":
    main()
