"""Compile-only mode: slice names, and the real TPU compiler (libtpu, the test extra) on tiny config-only models."""

import json
import sys

import pytest

from rloo_jax.cli import main
from rloo_jax.errors import ConfigError
from rloo_jax.tpu import CHIPS, parse_slice, torus_shape
from tests.fixtures_models import tiny_checkpoint  # noqa: F401


@pytest.mark.parametrize(
    "name, chips, topology",
    [
        ("v5e-8", 8, "v5e:2x4"),
        ("v5litepod-16", 16, "v5e:4x4"),
        ("V5E-1", 1, "v5e:1x1"),
        ("v5e-256", 256, "v5e:16x16"),
        ("v6e-8", 8, "v6e:2x4"),
        ("v6e-64", 64, "v6e:8x8"),
        ("v5p-8", 4, "v5:2x2x1"),  # v5p and v4 names count TensorCores, 2 per chip
        ("v5p-16", 8, "v5:2x2x2"),
        ("v5p-128", 64, "v5:4x4x4"),
        ("v5p-384", 192, "v5:4x4x12"),  # the shapes Google lists: every side a multiple of 4, most cube-like
        ("v5p-768", 384, "v5:4x8x12"),
        ("v5p-1152", 576, "v5:4x12x12"),
        ("v4-8", 4, "v4:2x2x1"),
        ("v4-32", 16, "v4:2x2x4"),
        ("v4-64", 32, "v4:2x4x4"),
        ("v4-4096", 2048, "v4:8x16x16"),
    ],
)
def test_slice_names(name, chips, topology):
    slc = parse_slice(name)
    assert (slc.chips, slc.topology_name) == (chips, topology)


def test_slice_facts_and_bad_names():
    assert parse_slice("v5e-8").chip.hbm_bytes == int(15.75 * 2**30)  # what the compiler makes available
    assert parse_slice("v5p-8").chip.chip_config == "megacore" and CHIPS["v6e"].peak_bf16_flops == 918e12
    assert torus_shape(8, 2) == (2, 4) and torus_shape(64, 3) == (4, 4, 4)
    for bad, msg in [("v9-8", "not a TPU slice name"), ("v5e-3", "sizes 1, 4, 8"), ("tpu", "not a TPU slice"),
                     ("v5p-24", "no standard v5p slice has 12 chips"), ("v4-7", "sizes")]:
        with pytest.raises(ConfigError, match=msg):
            parse_slice(bad)


def config_only_model(root, hf_config, tokenizer_dir):
    """A folder with config.json and a tokenizer only: no weights."""
    import shutil

    folder = root / "config_only"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder


TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=160, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def run_main(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def common(tmp_path, model):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--reward_funcs", "format",
            "--output_dir", str(tmp_path / "out"), "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_prompt_length", "16", "--prompt_bucket", "16", "--max_completion_length", "32", "--beta", "0.04",
            "--compile_only", "--compilation_cache", "false"]


def test_compile_only_reports_a_fitting_run(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    model = config_only_model(tmp_path, TINY_LLAMA, tiny_checkpoint("tokenizer"))
    assert not list(model.glob("*.safetensors"))
    # the einsum attention: the FLOPs below are worked out for it (the kernels' padding to 128-wide blocks is
    # what dominates at these 16 + 32 tokens; test_fused_attention_in_the_report covers them)
    code, out, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-4", "--eval_steps", "5",
                                                                "--steps_per_generation", "2",
                                                                "--attn_implementation", "eager"])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    assert report["topology"] == "v5e-4" and report["chips"] == 4 and report["fits"] is True
    assert report["hbm_bytes_per_chip"] == int(15.75 * 2**30)
    # every program the loop runs: the rollout (the sampler, then the reference / old log-prob pass), the update,
    # the records' advantages, the evaluation sampler
    assert set(report["programs"]) == {"rollout", "update", "score", "eval_rollout"}
    assert set(report["programs"]["rollout"]["parts"]) == {"sample", "finish"}
    for p in report["programs"].values():
        assert p["fits"] and 0 < p["peak_bytes_per_chip"] < 2**30 and p["compile_seconds"] > 0
        assert p["peak_bytes_per_chip"] >= p["temp_bytes"] + p["resident_bytes"] - p["alias_bytes"]
        assert set(p) >= {"argument_bytes", "temp_bytes", "flops", "output_bytes"}
    assert report["programs"]["update"]["flops"] > report["programs"]["rollout"]["flops"] > 0
    # what the model needs (tests/test_efficiency.py works these out by hand), per chip of 4; the compiler's
    # update recomputes the forward (full remat: ~4/3), its rollout decodes into a padded KV cache. Off-policy
    # (steps_per_generation 2), the rollout runs the old log-probs' training forward beside the reference pass.
    rollout, update = report["programs"]["rollout"], report["programs"]["update"]
    assert (rollout["model_flops"], update["model_flops"]) == ((202440704 + 2 * 208437248) / 4, 3 * 208437248 / 4)
    assert 1.0 < rollout["flops_ratio"] < 1.1 and 1.2 < update["flops_ratio"] < 1.4
    assert update["flops_ratio"] == update["flops"] / update["model_flops"]
    # decode: 31 steps (the first token comes from the prefill); floor = bf16 matrices + this chip's KV caches
    # (bf16 None: on for a TPU)
    assert rollout["decode_steps"] == 31 and rollout["decode_floor_bytes_per_step"] == 2 * 83968 + 294912 / 4
    per_step = rollout["decode_hbm_bytes_per_step"] + rollout["decode_ici_bytes_per_step"]
    assert rollout["decode_bytes_ratio"] == per_step / rollout["decode_floor_bytes_per_step"] > 0
    chip = report["roofline"]
    for name, p in report["programs"].items():
        assert p["bytes_accessed"] > 0 and (name == "score" or p["ici_bytes"] > 0)  # fsdp gathers the weights
        assert p["estimated_seconds"] >= max(p["flops"] / chip["peak_bf16_flops_per_chip"],
                                             p["bytes_accessed"] / chip["hbm_bytes_per_second"])
    assert report["estimated_step_seconds"] == rollout["estimated_seconds"] + update["estimated_seconds"]
    assert "x model" in out and "rollout decode: 31 steps" in out and "est. step:" in out
    assert max(len(line) for line in out.splitlines() if not line.startswith(("FITS", "report"))) <= 118
    # the mesh is the slice's: fsdp over its 4 chips; the batch validated for them (4 x 4 x 2 completions)
    assert report["settings"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["settings"]["completions_per_generation"] == 32 and report["settings"]["remat_policy"] == "full"
    # the sampler's own mesh, resolved for a v5e chip: the whole (tiny) model on every chip, data-parallel over 4,
    # and what moving the weights into it costs: all-gathers receive 3/4 of the bf16 matrices (and norms), in TPU
    # tiles that pad these tiny matrices' minor dimensions (1.81x the bare bytes measured)
    assert report["settings"]["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    reshard = report["rollout_reshard"]
    assert 3 * 2 * 83968 / 4 <= reshard["ici_bytes_per_chip"] < 2 * 3 * 2 * 83968 / 4
    assert reshard["copy_bytes_per_chip"] >= 2 * 83968 and 0 < reshard["estimated_seconds"] < 1e-3
    assert "rollout layout: data 4 x fsdp 1 x tensor 1 (training: 1 x 4 x 1)" in out
    assert "FITS: every program fits v5e-4" in out and "update" in out
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


def tool_calling_tokenizer(root):
    """The tool-calling demo's tokenizer (a byte-level BPE, TRL's Qwen3 training chat template, the Qwen3 response
    template) trained on a few of its conversations, saved to a folder: seconds, no SFT."""
    import random

    from rloo_jax import demo_tools

    rng = random.Random(0)
    probe = demo_tools.build_tokenizer([""], vocab_size=300)
    texts = [probe.apply_chat_template(demo_tools.conversation(kind, 3, 4, rng), tools=demo_tools.TOOLS,
                                       tokenize=False) for kind in demo_tools.KINDS]
    folder = root / "tool_tokenizer"
    demo_tools.build_tokenizer(texts, vocab_size=300).save_pretrained(folder)
    return folder


def test_compile_only_covers_a_tool_calling_grpo_run(tmp_path, capsys):
    """--compile_only on a GRPO run (vespo, KL in the loss, off-policy, the adaptive entropy controller) with tools:
    the TPU compiler builds its multi-turn rollout (the first turn's prefill and decode, a resumed turn's prefill of
    tool results, the close, the reference and old log-probs' forwards) and its update (the loss, the entropies,
    the controller's state replicated over the slice) for the same batch as RLOO's test above. The rollout line
    counts the C decode steps once over the turns and max_tool_calling_iterations resumes, so its model FLOPs are a
    single-turn rollout's."""
    tokenizer = tool_calling_tokenizer(tmp_path)
    model = config_only_model(tmp_path, dict(TINY_LLAMA, vocab_size=320), tokenizer)
    args = common(tmp_path, model)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hello"}]}) + "\n")
    args[args.index("--max_prompt_length") + 1] = "128"  # the tools' schemas are in the prompt
    code, out, err = run_main(capsys, ["grpo", *args, "--topology", "v5e-4",
                                       "--steps_per_generation", "2", "--attn_implementation", "eager",
                                       "--loss_type", "vespo", "--entropy_coef", "0.01", "--use_adaptive_entropy",
                                       "true", "--tools", "rloo_jax.demo_tools:multiply",
                                       "--max_tool_calling_iterations", "3", "--tool_suffix_bucket", "32"])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    assert report["fits"] is True and set(report["programs"]) == {"rollout", "update", "score"}
    s = report["settings"]
    assert (s["algorithm"], s["loss_type"], s["beta"], s["recompute_old_logps"]) == ("grpo", "vespo", 0.04, True)
    assert s["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and s["completions_per_generation"] == 32
    rollout, update = report["programs"]["rollout"], report["programs"]["update"]
    parts = rollout["parts"]
    assert list(parts) == ["turns_start", "turns_resume@32 x3", "turns_close", "finish"]
    # every turn's decoding at the first turn's line: C = 32 steps; a resume prefills, its decode loop not counted
    assert rollout["decode_steps"] == parts["turns_start"]["decode_steps"] == 32
    assert parts["turns_resume@32 x3"]["decode_steps"] == 0
    assert rollout["estimated_seconds"] == pytest.approx(sum(p["estimated_seconds"] for p in parts.values()))
    assert parts["turns_resume@32 x3"]["flops"] > 0 and parts["turns_close"]["model_flops"] == 0
    # prompts 128 wide: sampling (prefill + 32 decode steps) + the reference and old log-probs' forwards
    assert rollout["model_flops"] == parts["turns_start"]["model_flops"] + parts["finish"]["model_flops"]
    # the compiler's FLOPs but the resumes' are about the model's, as in a single-turn rollout (measured 1.098x);
    # the resumes add their padded prefills (3 x 33 positions a row against the model's count of 32 slots decoded);
    # the update: measured 1.41x at 160 positions (RLOO's test above, 48 positions: 1.2-1.4x)
    resumes = parts["turns_resume@32 x3"]["flops"]
    assert 1.0 < (rollout["flops"] - resumes) / rollout["model_flops"] < 1.15 and 1.2 < update["flops_ratio"] < 1.5
    for p in report["programs"].values():
        assert p["fits"] and 0 < p["peak_bytes_per_chip"] < 2**30 and p["compile_seconds"] > 0
    assert "FITS: every program fits v5e-4" in out
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_compile_only_with_lora_and_completion_buckets(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """LoRA: the adapters are the trained state (two forwards of model FLOPs per update: no weight gradients for
    the base); completion_bucket 8 of 32: the update compiled at every narrower width too, cheaper each."""
    model = config_only_model(tmp_path, TINY_LLAMA, tiny_checkpoint("tokenizer"))
    code, out, err = run_main(capsys, common(tmp_path, model) + [
        "--topology", "v5e-4", "--use_peft", "--lora_target_modules", "all-linear", "--lora_r", "4",
        "--completion_bucket", "8", "--steps_per_generation", "2",
        "--attn_implementation", "eager"])  # at 8-32 tokens splash's 128-wide blocks would be all padding
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    programs = report["programs"]
    # at each narrower width an early-ending batch runs its own reference pass, update and records' advantages
    assert set(programs) == {"rollout", "update", "score"} | {f"{n}@{w}" for n in ("finish", "update", "score")
                                                              for w in (8, 16)}
    assert set(programs["rollout"]["parts"]) == {"sample", "longest", "finish"}
    # the frozen base: 2 forwards; the adapters (8192 parameters): 6 FLOPs per parameter and token, 8 x 16 prompt
    # and 32 x 32 completion tokens
    assert programs["update"]["model_flops"] == (2 * 208437248 + 6 * 8192 * (8 * 16 + 32 * 32)) / 4
    flops = [programs[n]["flops"] for n in ("update@8", "update@16", "update")]
    assert flops == sorted(flops) and flops[0] < 0.6 * flops[2]
    # the estimated step: the rollout and the full-width update, not the narrower ones
    assert report["estimated_step_seconds"] == programs["rollout"]["estimated_seconds"] + programs["update"][
        "estimated_seconds"]
    # 2 layers x 7 projections x (din + dout) x r 4: the trained parameters
    assert report["settings"]["trainable_params"] == 2 * 4 * (4 * (64 + 64) - 2 * 32 + 2 * (64 + 128) + (128 + 64))


def test_rollout_mesh_moves_decode_off_ici(tmp_path, tiny_checkpoint, capsys, monkeypatch):  # noqa: F811
    """FSDP over 4 chips: a decode step on the training mesh all-gathers the weights over ICI at every step (the
    negative control: `weights_stay` off), or moves its 16 rows to the matrices' shards (`stationary_matmul`), which
    on this tiny model crosses about as many bytes (the TPU compiler sums 64-wide partial products with
    all-reduces; tests/test_mesh.py shows the weights stay put). On a mesh of its own the sampler moves the weights
    once per generation: whole on every chip (the default for this tiny model), or tensor-parallel over 2 (each
    chip reads half the matrices at every step)."""
    from rloo_jax import mesh as rmesh

    model = config_only_model(tmp_path, TINY_LLAMA, tiny_checkpoint("tokenizer"))
    rollouts, outs = {}, {}
    for layout in ("gathers", "1,4,1", None, "2,1,2"):
        extra = [] if layout is None else ["--rollout_mesh", "1,4,1" if layout == "gathers" else layout]
        with monkeypatch.context() as patch:
            if layout == "gathers":
                patch.setattr(rmesh, "weights_stay", lambda *args: False)
            code, out, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-4", *extra])
        assert code == 0, err
        report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
        assert report["settings"]["attn_implementation"] == "splash"  # the default for a TPU
        rollouts[layout], outs[layout] = report["programs"]["rollout"], out
        sizes = map(int, ("1,4,1" if layout == "gathers" else layout or "4,1,1").split(","))
        assert report["settings"]["rollout_mesh"] == dict(zip(("data", "fsdp", "tensor"), sizes, strict=True))
    gathers, moves, whole, tp = (rollouts[k] for k in ("gathers", "1,4,1", None, "2,1,2"))
    # the report names the option where the decode steps wait on ICI, and only there
    advice = "decode is ICI-bound (on FSDP a step gathers the weights, or its rows' partial sums cross"
    assert advice in outs["gathers"] and advice not in outs[None] and advice not in outs["2,1,2"]
    assert gathers["decode_ici_bytes_per_step"] > 3 * 2 * 73728 / 4  # 3/4 of the blocks' bf16 matrices
    assert 0 < moves["decode_ici_bytes_per_step"] < gathers["decode_ici_bytes_per_step"]
    # what still crosses: the rows' finished flags and sampled tokens (768 bytes)
    assert whole["decode_ici_bytes_per_step"] < 0.01 * gathers["decode_ici_bytes_per_step"]
    assert whole["decode_bytes_ratio"] < gathers["decode_bytes_ratio"]
    # the floor on fsdp 4 (where the rows move): a quarter of every matrix (the LM head's too: 16 x 4 < 64 x 2)
    # and an eighth of the KV caches (half the completions of the test above); tensor-parallel: half the matrices,
    # two all-reduces per layer cross ICI instead
    assert moves["decode_floor_bytes_per_step"] == 2 * 83968 / 4 + 294912 / 8
    assert tp["decode_floor_bytes_per_step"] == 2 * 83968 / 2 + 294912 / 8
    assert 0 < tp["decode_ici_bytes_per_step"] < 0.2 * gathers["decode_ici_bytes_per_step"]


def test_compile_only_says_what_does_not_fit(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    big = dict(TINY_LLAMA, vocab_size=64000, hidden_size=8192, intermediate_size=22016, num_hidden_layers=1,
               num_attention_heads=64, num_key_value_heads=8)  # ~1.9B parameters: f32 + AdamW > 16 GiB on one chip
    model = config_only_model(tmp_path, big, tiny_checkpoint("tokenizer"))
    code, out, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-1"])
    assert code == 1, err
    verdict = [line for line in out.splitlines() if line.startswith("DOES NOT FIT")]
    assert len(verdict) == 1
    assert "over the 15.75 GiB of a v5e chip" in verdict[0] and "--mu_dtype bfloat16" in verdict[0]
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    assert report["fits"] is False and not report["programs"]["rollout"]["fits"]


def test_the_peak_is_what_the_compiler_holds(tmp_path, tiny_checkpoint, capsys, monkeypatch):  # noqa: F811
    """A program's temporaries in the report are the temp heap the compiler assigns (`aot.temp_heap_bytes`), plus
    its code: under a limit of exactly the program's arguments + that heap + code the compiler packs it, and under a
    limit that holds its arguments alone it refuses, which the report gives as "does not fit" with the compiler's
    figure. (memory_analysis' temporaries count the heap's fragmentation again: at least the heap, BENCHMARKS.md.)"""
    from rloo_jax import aot

    real, seen, mib = aot.compile_program, {}, 2**20

    def also_under_limits(name, lower, hbm, resident):
        report = real(name, lower, hbm, resident)
        if name == "update":
            need = report.argument_bytes + report.temp_bytes + report.code_bytes  # its own arguments: resident 0
            seen.update(report=report, tight=real(name, lower, -(-need // mib) * mib + mib, 0),
                        below=real(name, lower, report.argument_bytes, 0))
        return report

    monkeypatch.setattr(aot, "compile_program", also_under_limits)
    model = config_only_model(tmp_path, TINY_LLAMA, tiny_checkpoint("tokenizer"))
    code, _, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-1"])
    assert code == 0, err
    report, tight, below = seen["report"], seen["tight"], seen["below"]
    assert 0 < report.temp_bytes <= report.analysis_temp_bytes and report.code_bytes > 0
    assert tight.fits and tight.temp_bytes <= report.temp_bytes
    assert not below.fits and below.peak_bytes_per_chip > report.argument_bytes


def test_compile_only_input_errors_exit_2(tmp_path, tiny_checkpoint, capsys, monkeypatch):  # noqa: F811
    model = config_only_model(tmp_path, TINY_LLAMA, tiny_checkpoint("tokenizer"))
    code, _, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5x-8"])
    assert code == 2 and "not a TPU slice name" in err and "v5p-8" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(capsys, common(tmp_path, model))
    assert code == 2 and "--topology" in err
    # per_device_train_batch_size 4 on 8 chips x 1 step = 32 completions: not whole groups of 3
    code, _, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-8", "--num_generations", "3"])
    assert code == 2 and "divisible by num_generations" in err
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as if the tpu extra were not installed
    code, _, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-4"])
    assert code == 2 and "pip install 'rloo_jax[tpu]'" in err
    assert not (tmp_path / "out").exists()


def test_the_compiler_sees_the_memory_plan(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """What the options are for, measured by the TPU compiler: remat shrinks the update's temporaries; bf16
    first moments shrink what stays resident."""
    model = config_only_model(tmp_path, dict(TINY_LLAMA, hidden_size=128, intermediate_size=512, num_hidden_layers=4),
                              tiny_checkpoint("tokenizer"))
    update = {}
    for name, extra in [("none", ["--gradient_checkpointing", "false"]), ("full", []),
                        ("mu_bf16", ["--mu_dtype", "bfloat16"])]:
        # the einsum attention, whose scores remat frees per block (the kernels keep none: test below); one
        # completion width (no update@128 to compile: a third of each run's compile time)
        code, _, err = run_main(capsys, common(tmp_path, model) + ["--topology", "v5e-1", "--max_completion_length",
                                                                    "256", "--completion_bucket", "0",
                                                                    "--attn_implementation", "eager", *extra])
        assert code == 0, err
        update[name] = json.loads((tmp_path / "out" / "compile_report.json").read_text())["programs"]["update"]
    assert update["full"]["temp_bytes"] < 0.5 * update["none"]["temp_bytes"]
    # and what remat costs: the forward again (its last matmuls, whose outputs no gradient needs, excepted)
    assert update["none"]["model_flops"] == update["full"]["model_flops"]
    assert 1.0 < update["none"]["flops_ratio"] < 1.15 < update["full"]["flops_ratio"] < 1.5
    assert update["mu_bf16"]["resident_bytes"] < update["full"]["resident_bytes"]


@pytest.mark.slow
def test_fused_attention_holds_no_score_matrix():
    """Forward + backward of one layer's shared-prompt attention compiled for a v5e chip (2 prompts of 128 tokens,
    each continued by 2 completions of 2048; heads 4, kv heads 2, head dim 128, bf16): the einsum's temporaries
    hold its float32 scores [rows, heads, C, P + C] (and more); the splash kernels' (the prompts' causal call and
    the completions') are under a tenth of one such matrix."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax.models import attention
    from rloo_jax.tpu import quiet_stderr, topology_devices

    one = NamedSharding(Mesh(np.array(topology_devices(parse_slice("v5e-1"))), ("x",)), PartitionSpec())
    b, g, p, c, h, k, dh = 2, 2, 128, 2048, 4, 2, 128

    def arg(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    def loss(impl, args, pmask, cmask):
        c_pos = jnp.repeat(pmask.sum(-1), g)[:, None] + jnp.cumsum(cmask, axis=-1) - 1
        fn = attention.shared_prompt(pmask, jnp.cumsum(pmask, -1), cmask, c_pos, implementation=impl, window=None,
                                     dtype=jnp.bfloat16)
        return sum(jnp.sum(o.astype(jnp.float32)) for o in fn(*args))

    args = (arg(b, p, h, dh), arg(b * g, c, h, dh), arg(b, p, k, dh), arg(b, p, k, dh), arg(b * g, c, k, dh),
            arg(b * g, c, k, dh))
    masks = (arg(b, p, dtype=jnp.int32), arg(b * g, c, dtype=jnp.int32))
    temps = {}
    for impl in ("eager", "splash"):
        with quiet_stderr(), attention.compile_target("tpu"):
            step = jax.jit(jax.grad(lambda a, pm, cm, impl=impl: loss(impl, a, pm, cm)))
            temps[impl] = step.lower(args, *masks).compile().memory_analysis().temp_size_in_bytes
    scores = b * g * h * c * (p + c) * 4
    assert temps["eager"] > scores > 10 * temps["splash"]


def test_hlo_counts_attention_kernel_flops():
    """The TPU compiler counts no FLOPs inside a Pallas kernel: `hlo` reads the forward kernel's from the name
    scope the caller gives it and scales them for the backward kernels. Causal T=256 in one 256 x 256 block:
    the forward kernel does 4 * B * H * Dh * 256^2; a gradient adds dq (x1.5) and dk/dv (x2)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.models import attention
    from rloo_jax.tpu import quiet_stderr, topology_devices

    one = NamedSharding(Mesh(np.array(topology_devices(parse_slice("v5e-1"))), ("x",)), PartitionSpec())
    b, t, h, k, dh = 2, 256, 4, 2, 128
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.bfloat16, sharding=one)
    kv = jax.ShapeDtypeStruct((b, t, k, dh), jnp.bfloat16, sharding=one)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=one)

    def fwd(q, k, v, s):
        return attention.splash_attention(q, k, v, s, s)

    def loss(q, k, v, s):
        return jnp.sum(fwd(q, k, v, s).astype(jnp.float32))

    with quiet_stderr(), attention.compile_target("tpu"):
        forward = jax.jit(fwd).lower(q, kv, kv, seg).compile().as_text()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()
    kernel = 4 * b * h * dh * 256 * 256
    assert "tpu_custom_call" in forward and hlo.flops(forward) == kernel
    assert hlo.flops(grad) == kernel * (1 + 1.5 + 2)


def test_hlo_flops_count_every_loop_iteration():
    """XLA's cost_analysis counts a loop body once; rloo_jax.hlo.flops counts it at its trip count."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.tpu import topology_devices

    mesh = Mesh(np.array(topology_devices(parse_slice("v5e-1"))), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    w = jax.ShapeDtypeStruct((8, 256, 256), jnp.bfloat16, sharding=one)
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16, sharding=one)

    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    def unrolled(w, x):
        for i in range(8):
            x = x @ w[i]
        return x

    def nested(w, x):  # 3 x 8 matmuls, and a data-dependent loop bounded by 5 around one more
        h = jax.lax.scan(lambda h, _: (scanned(w, h), None), x, None, length=3)[0]
        return jax.lax.while_loop(lambda c: (c[0] < 5) & (jnp.sum(c[1]) < 1e30), lambda c: (c[0] + 1, c[1] @ w[0]),
                                  (0, h))[1]

    one_matmul = 2 * 128 * 256 * 256
    counted = {f.__name__: hlo.flops(jax.jit(f).lower(w, x).compile().as_text()) for f in (scanned, unrolled, nested)}
    assert counted == {"scanned": 8 * one_matmul, "unrolled": 8 * one_matmul, "nested": (3 * 8 + 5) * one_matmul}
    xla = jax.jit(scanned).lower(w, x).compile().cost_analysis()["flops"]
    assert xla == one_matmul  # what XLA itself reports for the scan: one iteration


def test_hlo_bytes_match_xla_and_count_every_loop_iteration():
    """Bytes at the fusion boundary: XLA's own count on loop-free programs; a loop body at its trip count (XLA
    counts it once, whatever the count); a loop found by its `jax.named_scope`; a matmul's inputs read once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.tpu import quiet_stderr, topology_devices

    def compiled(f, *args):
        with quiet_stderr():  # the cache donated: updated in place
            return jax.jit(f, donate_argnums=0 if f is update_in_place else ()).lower(*args).compile()

    def update_in_place(c, u, i):
        return jax.lax.dynamic_update_slice(c, u, (i, 0, 0))

    one = Mesh(np.array(topology_devices(parse_slice("v5e-1"))), ("x",))
    four = Mesh(np.array(topology_devices(parse_slice("v5e-4"))), ("x",))

    def sds(shape, dtype=jnp.float32, mesh=one, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or PartitionSpec()))

    cache, update, i = sds((64, 256, 128), jnp.bfloat16), sds((1, 256, 128), jnp.bfloat16), sds((), jnp.int32)
    loop_free = {
        "elementwise": (lambda a: jnp.exp(a) * 2, sds((256, 512))),
        "padded": (lambda a: jnp.exp(a) * 2, sds((10, 20))),  # laid out as 16 x 128
        "convert_transpose": (lambda a: (a.T + 1).astype(jnp.bfloat16), sds((512, 256))),
        "concat_cumsum": (lambda a, b: jnp.cumsum(jnp.concatenate([a, b]), -1), sds((64, 256)), sds((32, 256))),
        "update_in_place": (update_in_place, cache, update, i),
        "slice": (lambda c, i: jax.lax.dynamic_slice(c, (i, 0, 0), (1, 256, 128)) * 2, cache, i),
        "all_gather": (lambda a: jax.lax.with_sharding_constraint(a * 2, NamedSharding(four, PartitionSpec())) + 1,
                       sds((512, 1024), mesh=four, spec=PartitionSpec("x"))),
    }
    for name, (f, *args) in loop_free.items():
        c = compiled(f, *args)
        assert hlo.bytes_accessed(c.as_text()) == c.cost_analysis()["bytes accessed"], name
    # the all-gather receives 3 of its 4 blocks over ICI; the update writes 64 KiB into the cache, not 4 MiB
    assert hlo.analyze(compiled(*loop_free["all_gather"][:2]).as_text()).total.ici_bytes == 3 * 512 * 1024
    assert hlo.bytes_accessed(compiled(*loop_free["update_in_place"]).as_text()) < 2 * 256 * 128 * 2 + 8192

    def loop(n):  # n iterations of an elementwise body; named as the sampler names its decode loop
        def f(w, x):
            with jax.named_scope("decode_loop"):
                return jax.lax.fori_loop(0, n, lambda j, h: jnp.tanh(h * w[j]), x)

        return compiled(f, sds((n, 256, 512)), sds((256, 512)))

    c8, c16 = loop(8), loop(16)
    a8, a16 = hlo.analyze(c8.as_text()), hlo.analyze(c16.as_text())
    found = hlo.named_loop(a8, "decode_loop")
    assert found is not None and (found.trips, found.runs) == (8, 1) and found.op_name.endswith("decode_loop/while")
    assert hlo.named_loop(a8, "decode") is None and hlo.named_loop(a16, "decode_loop").trips == 16
    # one iteration reads h and one slice of w and writes h (f32 [256, 512]), plus a few scalars
    assert 3 * 256 * 512 * 4 <= found.per_iteration.bytes < 3 * 256 * 512 * 4 + 8192
    assert a16.total.bytes - a8.total.bytes == 8 * found.per_iteration.bytes
    assert c16.cost_analysis()["bytes accessed"] == c8.cost_analysis()["bytes accessed"]  # XLA: the body once
    # a matmul reads each input once (the TPU cost model also charges its tiling's re-reads)
    c = compiled(lambda a, b: a @ b, sds((256, 512), jnp.bfloat16), sds((512, 1024), jnp.bfloat16))
    logical = 2 * (256 * 512 + 512 * 1024 + 256 * 1024)
    assert hlo.bytes_accessed(c.as_text()) == logical < c.cost_analysis()["bytes accessed"]


@pytest.mark.parametrize("scan_layers,dh", [(True, 128), (False, 128), (True, 64)])
def test_a_decode_step_reads_its_kv_cache_once(scan_layers, dh, monkeypatch):
    """One decode step of a model whose KV caches do not fit on-chip memory (v5e, fsdp over 4 chips, gathered
    bf16 weights): it moves <= 1.1x the floor (its rows' caches + the matrices) through HBM, and nothing of the
    caches over ICI. The traps it pins (BENCHMARKS.md): splitting the cache rows into (prompt, sample) in the
    attention dots made the compiler copy each layer's cache slice first, and the RoPE'd key slot let it pick a
    key-cache layout its dots cannot read in place (one more copy): 3.40x here together; a layout constraint the
    SPMD partitioner sees whole gathers every cache onto every chip: 14x here, 72x on the 8B. The weights are
    whole on every chip here, which the rows-to-weights rule cannot see (it reads the rule table, which splits
    them over fsdp): it is off, so no rows cross ICI either.
    A 64-wide head dimension (gpt-oss-20b's) is stored slots minor (`kv_cache_layout`): its one-slot write
    rewrites the 128 slots of its tiles, so the floor here adds 128 / 1024 of the caches (measured 1.02x of that;
    1.14x the plain floor); row-major, as the 128-wide heads are, the same step moved 7.7x the floor (the negative
    control: each slot padded to 128 lanes, and copied)."""
    from rloo_jax import mesh as rmesh

    monkeypatch.setattr(rmesh, "weights_stay", lambda *args: False)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rloo_jax import hlo
    from rloo_jax.mesh import KV_CACHE_AXES, row_major
    from rloo_jax.models import transformer
    from rloo_jax.models.attention import compile_target
    from rloo_jax.models.config import ModelConfig
    from rloo_jax.models.transformer import CausalLM, DecodeCache, PromptCache
    from rloo_jax.tpu import quiet_stderr, topology_devices

    layers, rows, heads, slots, b, p = 2, 64, 1024 // dh, 1024, 8, 16
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=256, hidden_size=256, num_layers=layers,
                      num_heads=heads, num_kv_heads=heads, head_dim=dh, intermediate_size=512, norm_eps=1e-5,
                      hidden_act="silu", rope_theta=1e4, rotary_dim=dh, dtype="bfloat16", param_dtype="bfloat16",
                      scan_layers=scan_layers)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
    mesh = Mesh(np.array(topology_devices(parse_slice("v5e-4"))).reshape(1, 4, 1), ("data", "fsdp", "tensor"))

    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    params = jax.tree.map(lambda x: sds(x.shape, x.dtype), params)  # gathered: whole on every chip
    batch = ("data", "fsdp")
    rows_spec = (None, batch)
    cache = DecodeCache(
        prompt=PromptCache(k=sds((layers, b, heads, p, dh), jnp.bfloat16, *rows_spec),
                           v=sds((layers, b, heads, p, dh), jnp.bfloat16, *rows_spec),
                           mask=sds((b, p), jnp.int32, batch), lengths=sds((b,), jnp.int32, batch)),
        k=sds((layers, rows, heads, slots, dh), jnp.bfloat16, *rows_spec),
        v=sds((layers, rows, heads, slots, dh), jnp.bfloat16, *rows_spec))

    def cost():
        def step(params, tokens, i, cache):  # a new function: traced again (after the monkeypatch below)
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), compile_target("tpu"):
                return nnx.merge(graphdef, params).decode_step(tokens, i, cache)

        with quiet_stderr():
            compiled = jax.jit(step, donate_argnums=3).lower(
                params, sds((rows,), jnp.int32, batch), sds((), jnp.int32), cache).compile()
        return hlo.analyze(compiled.as_text()).total

    matrices = sum(x.size for x in jax.tree.leaves(params) if x.ndim >= 2) * 2
    caches = (2 * layers * rows * heads * slots * dh + 2 * layers * b * heads * p * dh) * 2 // 4
    writes = 0 if dh % 128 == 0 else caches * 128 // slots
    measured = cost()
    assert measured.hbm_bytes <= 1.1 * (matrices + caches + writes)
    assert measured.ici_bytes < 0.01 * caches
    if dh % 128:
        monkeypatch.setattr(transformer, "kv_cache_layout", lambda c: row_major(c, KV_CACHE_AXES))
        assert cost().hbm_bytes > 4 * (matrices + caches)


def test_rollout_mesh_default_follows_device_memory():
    """None (the default): where FSDP splits the weights, whole weights on every device where one compute-dtype
    copy takes at most 1/4 of a device's memory, else tensor-parallel as far as the heads allow where that share
    fits; the training mesh where no share is that small, where nothing is split over fsdp, and without a device
    figure (CPU); an explicit value wins."""
    import types

    import jax
    from flax import nnx

    from rloo_jax.cli import config_from_dict
    from rloo_jax.mesh import rollout_mesh_shape
    from rloo_jax.models.config import ModelConfig
    from rloo_jax.models.transformer import CausalLM

    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=100, hidden_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=8, intermediate_size=32, norm_eps=1e-5, hidden_act="silu",
                      rope_theta=1e4, rotary_dim=8)
    run = types.SimpleNamespace(model=nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
    # embed + head 2 x 100 x 16, q/k/v/o 4 x 16 x 16, gate/up/down 3 x 16 x 32, two norms and the final one
    params = 2 * 1600 + 4 * 256 + 3 * 512 + 3 * 16
    assert sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param))) == params

    def resolved(device_bytes, **options):
        values = {"model_name_or_path": "demo", "dataset_name": "demo", "reward_funcs": ["format"],
                  "per_device_train_batch_size": 4, "num_generations": 4, **options}
        return rollout_mesh_shape(config_from_dict(values, device_count=4), run.model, device_bytes)

    copy_bf16 = 2 * params
    assert resolved(4 * copy_bf16, bf16=True) == (4, 1, 1)  # exactly 1/4: whole weights on every device
    assert resolved(4 * copy_bf16 - 1, bf16=True) == (2, 1, 2)  # half of them on each: 2 heads over 2 devices
    assert resolved(2 * copy_bf16 - 1, bf16=True) == (1, 4, 1)  # no share small enough (the heads stop at 2)
    assert resolved(4 * copy_bf16, bf16=False) == (2, 1, 2)  # float32: twice the bytes
    assert resolved(2 * copy_bf16, bf16=True, fsdp=2, tensor_parallel=2) == (2, 1, 2)  # training's tensor split kept
    assert resolved(10**12, fsdp=1, data_parallel=4) == (4, 1, 1)  # nothing to gather: the weights are whole
    assert resolved(None) == (1, 4, 1)  # this process's device: the CPU reports no memory figure
    assert resolved(1, rollout_mesh=(1, 1, 4)) == (1, 1, 4) and resolved(10**12, rollout_mesh=(-1, 1, 2)) == (2, 1, 2)
    with pytest.raises(ConfigError, match="rollout_mesh: .*needs 3 devices but 4"):
        resolved(None, rollout_mesh=(3, 1, 1))
