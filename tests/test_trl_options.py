"""Every option of TRL 1.16's RLOO is decided (supported / accepted / refused) in rloo_jax.trl_options, the loader
applies the decisions to YAML, the command line and RLOOConfig(...), and the README's table is generated from them."""

import dataclasses
import logging
import os
import re
import sys
from fractions import Fraction

import pytest
import trl
import yaml
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.rloo import RLOOScriptArguments

from rloo_jax.algorithms import GRPOConfig, RLOOConfig
from rloo_jax.cli import load_config, main
from rloo_jax.config import field_names, parse_argv
from rloo_jax.errors import ConfigError
from rloo_jax.loop import crossed
from rloo_jax.trl_options import split_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "pkg.mod:f"]
CLASSES = (trl.RLOOConfig, trl.ModelConfig, RLOOScriptArguments, trl.DatasetMixtureConfig)
GRPO_CLASSES = (trl.GRPOConfig, trl.ModelConfig, GRPOScriptArguments, trl.DatasetMixtureConfig)
TABLES = [(CLASSES, RLOOConfig.TRL_OPTIONS, RLOOConfig, RLOOConfig.TRL_SOURCES),
          (GRPO_CLASSES, GRPOConfig.TRL_OPTIONS, GRPOConfig, GRPOConfig.TRL_SOURCES)]


def trl_defaults(cls):
    """{field: class default} (dataclass defaults, before TRL's __post_init__)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


@pytest.mark.parametrize("classes, decisions, ours, sources", TABLES, ids=["rloo", "grpo"])
def test_every_trl_option_has_a_decision(classes, decisions, ours, sources):
    assert len(sources) == len(classes)
    own = [f.name for f in dataclasses.fields(classes[0])]
    assert trl.__version__.startswith("1.16") and len(own) >= 160  # ~115 of them from TrainingArguments
    undecided = sorted({f.name for c in classes for f in dataclasses.fields(c)} - set(decisions))
    assert undecided == [], f"decide these TRL options in rloo_jax/trl_options.py: {undecided}"
    stale = sorted(set(decisions) - {f.name for c in classes for f in dataclasses.fields(c)})
    assert stale == [], f"not TRL options (any more): {stale}"


@pytest.mark.parametrize("classes, decisions, ours, sources", TABLES, ids=["rloo", "grpo"])
def test_supported_means_our_field_and_only_then(classes, decisions, ours, sources):
    fields = set(field_names(ours))
    for name, decision in decisions.items():
        if decision.status == "supported":
            assert name in fields, f"{name} is marked supported but is no {ours.__name__} field"
        else:
            assert name not in fields, f"{name} is a {ours.__name__} field now: mark it supported"
        assert decision.why or decision.status == "supported", name


@pytest.mark.parametrize("cls, decisions, ours", [(c, t[1], t[2]) for t in TABLES for c in t[0]],
                         ids=lambda x: getattr(x, "__name__", ""))
def test_trl_defaults_ask_for_nothing_refused(cls, decisions, ours):
    """TRL's default of every accepted or refused option passes: only asking for a missing feature fails."""
    for name, default in trl_defaults(cls).items():
        if decisions[name].status != "supported":
            split_options({name: default}, field_names(ours), decisions)


def test_a_full_trl_config_dump_loads(tmp_path, caplog):
    """`trl.RLOOConfig(...).to_dict()` (every field, after TRL's __post_init__) as a YAML config."""
    dump = trl.RLOOConfig(output_dir=str(tmp_path / "trl"), bf16=False).to_dict()  # bf16 True needs a GPU in TRL
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(dump))
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(["--config", str(path), *REQUIRED])
    assert (cfg.output_dir, cfg.gradient_checkpointing, cfg.fsdp, cfg.debug) == (str(tmp_path / "trl"), True, -1, False)
    assert (cfg.learning_rate, cfg.beta, cfg.num_generations, cfg.report_to) == (1e-6, 0.05, 2, [])
    assert "TRL options with no effect here:" in caplog.text and "vllm_mode" in caplog.text


def test_a_full_trl_grpo_config_dump_loads_as_grpo(tmp_path, caplog):
    """`trl.GRPOConfig(...).to_dict()` as a YAML config of `python -m rloo_jax.train grpo`: TRL's GRPO defaults
    (beta 0, 8 generations, dapo) and its vLLM correction, which counts only with use_vllm."""
    dump = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, loss_type="cispo", epsilon_high=4.0,
                          scale_rewards=False).to_dict()
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(dump))
    grpo_required = [*REQUIRED[:2], "--dataset_name", "d", "--reward_funcs", "pkg.mod:f"]
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(["grpo", "--config", str(path), *grpo_required[2:], *grpo_required[:2]])
    assert isinstance(cfg, GRPOConfig)
    assert (cfg.beta, cfg.num_generations, cfg.loss_type, cfg.epsilon_high, cfg.scale_rewards) == (
        0.0, 8, "cispo", 4.0, "none")
    assert not cfg.importance_sampling_correction  # TRL's default true counts only with use_vllm
    on = load_config(["grpo", "--config", str(path), *grpo_required[2:], *grpo_required[:2], "--use_vllm", "true",
                      "--vllm_importance_sampling_mode", "token_truncate"])
    assert (on.importance_sampling_correction, on.importance_sampling_mode) == (True, "token_truncate")
    with pytest.raises(ConfigError, match="normalize_advantages is an option of RLOOConfig, not of GRPOConfig"):
        load_config(["grpo", *grpo_required, "--normalize_advantages", "true"])
    with pytest.raises(ConfigError, match="the command line names rloo but .* is a grpo config"):
        (tmp_path / "g.yaml").write_text("algorithm: grpo\n")
        load_config(["rloo", "--config", str(tmp_path / "g.yaml"), *grpo_required])
    assert isinstance(load_config(["--config", str(tmp_path / "g.yaml"), *grpo_required]), GRPOConfig)


def test_a_trl_yaml_with_its_usual_options_loads(tmp_path, caplog):
    path = tmp_path / "trl.yaml"
    path.write_text(
        "use_vllm: false\nvllm_mode: colocate\npush_to_hub: false\nrun_name: my-run\nreport_to: none\n"
        "eval_strategy: 'no'\neval_steps: 50\nlogging_strategy: steps\noptim: adamw_torch_fused\n"
        "warmup_steps: 0.1\nbf16: null\nfsdp: full_shard auto_wrap\ndtype: bfloat16\ngeneration_batch_size: 8\n"
    )
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(["--config", str(path), *REQUIRED])
    assert (cfg.run_name, cfg.eval_steps, cfg.warmup_steps, cfg.fsdp, cfg.param_dtype) == (
        "my-run", None, 0.1, -1, "bfloat16")  # eval_strategy no -> no evaluation; TRL's fsdp switch keeps ours
    assert "no effect here: vllm_mode (" in caplog.text  # set to something: named; off values and optim: not


@pytest.mark.parametrize(
    "option, message",
    [
        ("use_vllm: true", "use_vllm=True is not supported here: generation runs on the JAX sampler"),
        ("push_to_hub: true", "push_to_hub=True is not supported here: nothing is uploaded"),
        ("fp16: true", "fp16=True is not supported here: float16 needs loss scaling"),
        ("optim: sgd", "optim='sgd' cannot be honoured here: the optimizer is optax AdamW .accepted: an AdamW name"),
        ("eval_strategy: best", "eval_strategy='best' cannot be honoured here: evaluation runs every eval_steps or "
                                "at each epoch's end .accepted: no, steps, epoch."),
        ("save_strategy: 'no'", "save_strategy='no' cannot be honoured here: a run always writes checkpoints"),
        ("optim: adamw_8bit", "optim='adamw_8bit' is not supported here: optax has no 8-bit .or 4-bit. AdamW, .* "
                              "use --mu_dtype bfloat16 .*--use_peft .*--fsdp"),
        ("optim: paged_adamw_8bit", "optim='paged_adamw_8bit' is not supported here: optax has no 8-bit"),
        ("logging_steps: 1.5", r"logging_steps must be an integer >= 1 \(steps\) or a float in \(0, 1\) \(a ratio "
                               r"of the run's steps\) \(got 1.5\); fix --logging_steps"),
        ("save_steps: 0", r"save_steps must be an integer >= 1 \(steps\) or a float in \(0, 1\)"),
        ("generation_batch_size: 16", r"generation_batch_size=16 is not this run's generation batch .* = 8\)"),
        ("debug: underflow_overflow", "debug: 'underflow_overflow' is one of transformers' torch debug modes"),
    ],
)
def test_refused_values_exit_2_with_the_reason(option, message, tmp_path, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text(option + "\n")
    assert main(["--config", str(path), *REQUIRED, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_generation_and_model_init_kwargs_map_onto_our_options(tmp_path):
    """TRL's dict options, as a TRL recipe sets them: generation_kwargs override the sampling options beside them
    (TRL builds GenerationConfig(**its defaults, **generation_kwargs)); model_init_kwargs' dtype is the dtype option
    (bfloat16: param_dtype bfloat16). From Python, YAML and the command line (JSON text) alike."""
    cfg = RLOOConfig(output_dir="o", top_k=10, temperature=1.0, generation_kwargs={"top_k": 50, "temperature": 0.7,
                                                                                    "min_p": 0.1},
                     model_init_kwargs={"torch_dtype": "bfloat16"})
    assert (cfg.top_k, cfg.temperature, cfg.min_p, cfg.top_p, cfg.param_dtype) == (50, 0.7, 0.1, 1.0, "bfloat16")
    assert cfg.generation_kwargs == {"top_k": 50, "temperature": 0.7, "min_p": 0.1}  # readable, as on TRL's config
    assert RLOOConfig(output_dir="o", generation_kwargs={"do_sample": False, "top_k": 50}).top_k == 1  # greedy
    assert RLOOConfig(output_dir="o", model_init_kwargs={"dtype": "float32"}).param_dtype == "float32"
    assert RLOOConfig(output_dir="o", model_init_kwargs={"attn_implementation": "sdpa"}).attn_implementation is None
    path = tmp_path / "trl.yaml"
    path.write_text("generation_kwargs:\n  top_p: 0.9\n  repetition_penalty: 1.1\nmodel_init_kwargs: {dtype: auto}\n")
    cfg = load_config(["--config", str(path), *REQUIRED])
    assert (cfg.top_p, cfg.repetition_penalty, cfg.param_dtype) == (0.9, 1.1, "float32")
    cfg = load_config([*REQUIRED, "--generation_kwargs", '{"top_k": 5}', "--model_init_kwargs",
                       '{"torch_dtype": "bfloat16"}'])
    assert (cfg.top_k, cfg.param_dtype) == (5, "bfloat16")
    with pytest.raises(ConfigError, match=r"generation_kwargs: num_beams, suppress_tokens cannot be honoured here: the "
                                          r"sampler implements no other generate\(\) argument \(taken: temperature"):
        RLOOConfig(output_dir="o", generation_kwargs={"num_beams": 2, "suppress_tokens": [1], "top_k": 3})
    with pytest.raises(ConfigError, match="model_init_kwargs: device_map cannot be honoured here"):
        RLOOConfig(output_dir="o", model_init_kwargs={"device_map": "auto"})
    with pytest.raises(ConfigError, match="model_init_kwargs: dtype 'float16' cannot be honoured here"):
        RLOOConfig(output_dir="o", model_init_kwargs={"dtype": "float16"})
    with pytest.raises(ConfigError, match="generation_kwargs: '{top_k: 5}' is not a JSON object"):
        load_config([*REQUIRED, "--generation_kwargs", "{top_k: 5}"])


def test_cosine_with_min_lr_takes_its_floor_once():
    cfg = load_config([*REQUIRED, "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
                       '{"min_lr_rate": 0.1}'])
    assert (cfg.min_lr_rate, cfg.min_lr) == (0.1, None)
    assert RLOOConfig(output_dir="o", lr_scheduler_type="cosine_with_min_lr", min_lr=1e-7).min_lr == 1e-7
    with pytest.raises(ConfigError, match="needs one of min_lr or min_lr_rate .got neither."):
        RLOOConfig(output_dir="o", lr_scheduler_type="cosine_with_min_lr")
    with pytest.raises(ConfigError, match="needs one of min_lr or min_lr_rate .got min_lr and min_lr_rate."):
        RLOOConfig(output_dir="o", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 0.0,
                                                                                                "min_lr_rate": 0.1})
    with pytest.raises(ConfigError, match="min_lr_rate is the floor of lr_scheduler_type cosine_with_min_lr, not of "
                                          "linear"):
        RLOOConfig(output_dir="o", min_lr_rate=0.1)
    with pytest.raises(ConfigError, match="num_cycles 2 cannot be honoured here"):
        RLOOConfig(output_dir="o", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"num_cycles": 2})
    with pytest.raises(ConfigError, match="min_lr must be in .0, learning_rate."):
        RLOOConfig(output_dir="o", learning_rate=1e-6, lr_scheduler_type="cosine_with_min_lr", min_lr=1e-5)


def test_command_line_and_python_take_trl_names():
    # a bare TRL flag means true (refused here), an optional bool of ours too
    assert parse_argv(["--gradient_checkpointing", "--seed", "1"], RLOOConfig)[1] == {
        "gradient_checkpointing": "true", "seed": "1"}
    with pytest.raises(ConfigError, match="push_to_hub='true' is not supported"):
        load_config([*REQUIRED, "--push_to_hub"])
    assert load_config([*REQUIRED, "--use_vllm", "false", "--run_name", "r"]).run_name == "r"
    cfg = RLOOConfig(output_dir="o", use_vllm=False, vllm_mode="server", report_to="none", logging_steps=5)
    assert (cfg.output_dir, cfg.report_to, cfg.logging_steps, cfg.model_name_or_path) == ("o", ["none"], 5, None)
    with pytest.raises(ConfigError, match="use_vllm=True is not supported"):
        RLOOConfig(use_vllm=True)


@pytest.mark.parametrize("name", ["logging_steps", "save_steps", "eval_steps"])
@pytest.mark.parametrize("ratio, total", [(0.1, 25), (0.25, 10), (0.3, 7), (0.05, 100), (0.999, 3), (0.01, 16)])
def test_ratio_steps_resolve_as_transformers_does(name, ratio, total):
    """A float in (0, 1) is a ratio of the run's steps, resolved once the total is known to what transformers'
    TrainerState.compute_steps (its own code, run here) makes of it; integers stay as given."""
    from transformers.trainer_callback import TrainerState
    from transformers.training_args import TrainingArguments

    theirs = TrainerState()
    theirs.compute_steps(TrainingArguments(output_dir="o", **{name: ratio}), total)
    cfg = RLOOConfig(output_dir="o", **{name: ratio})
    assert getattr(cfg, name) == ratio and isinstance(getattr(cfg, name), float)
    assert getattr(cfg.with_intervals(total), name) == getattr(theirs, name)
    whole = RLOOConfig(output_dir="o", **{name: 7.0}).with_intervals(total)  # 7.0 is 7 steps
    assert getattr(whole, name) == 7 and isinstance(getattr(whole, name), int)
    assert getattr(load_config([*REQUIRED, f"--{name}", str(ratio)]), name) == ratio  # the command line too


def test_epoch_strategies_are_fields_and_trl_spellings_map():
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    cfg = RLOOConfig(output_dir="o", save_strategy=SaveStrategy.EPOCH, eval_strategy=IntervalStrategy.EPOCH)
    assert (cfg.save_strategy, cfg.eval_strategy, cfg.eval_steps, cfg.evaluates) == ("epoch", "epoch", None, True)
    assert not RLOOConfig(output_dir="o", eval_strategy="no", eval_steps=5).evaluates  # TRL's `no` wins
    assert not RLOOConfig(output_dir="o").evaluates
    assert load_config([*REQUIRED, "--save_strategy", "epoch"]).save_strategy == "epoch"
    # an epoch in optimizer steps, as num_train_epochs counts them: 16 prompts, 2 per generation batch of 2
    # micro-batches -> 16 micro-batches an epoch; gradient_accumulation_steps 2 -> 8 steps, 3 -> 16/3 (a step spans
    # two epochs; epoch e ends in step ceil(16 e / 3))
    def run(gas):
        return RLOOConfig(output_dir="o", per_device_train_batch_size=2, num_generations=2, steps_per_generation=2,
                          gradient_accumulation_steps=gas, num_train_epochs=3)

    assert (run(2).steps_per_epoch(16), run(2).total_steps(16)) == (8, 24)
    assert (run(3).steps_per_epoch(16), run(3).total_steps(16)) == (Fraction(16, 3), 16)
    assert [k for k in range(1, 17) if crossed(k - 1, k, Fraction(16, 3))] == [6, 11, 16]  # the loop's test
    assert crossed(4, 7, Fraction(16, 3)) and not crossed(6, 10, Fraction(16, 3))  # a generation batch of steps
    from rloo_jax.algorithms import PPOConfig

    ppo = PPOConfig(output_dir="o", gradient_accumulation_steps=4)  # a step is an update: a generation batch
    assert ppo.steps_per_epoch(10 * ppo.prompts_per_generation + 1) == 10  # the partial batch dropped


def test_warmup_steps_are_steps_or_a_fraction():
    from rloo_jax.optimizer import warmup_steps

    def of(**kw):
        return load_config(REQUIRED + [x for k, v in kw.items() for x in (f"--{k}", str(v))])

    assert [warmup_steps(of(warmup_steps=w), 25) for w in (0, 3, 0.1)] == [0, 3, 3]  # 0.1 x 25 rounded up
    assert warmup_steps(of(warmup_ratio=0.1), 25) == 3
    with pytest.raises(ConfigError, match="set warmup_steps or warmup_ratio, not both"):
        of(warmup_steps=2, warmup_ratio=0.1)
    with pytest.raises(ConfigError, match="warmup_steps must be an integer >= 1 .steps. or a float in"):
        of(warmup_steps=2.5)


def test_the_tables_are_generated_from_the_decisions():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import trl_table
    finally:
        sys.path.pop(0)
    assert trl_table.main(["--check"]) == 0, "run python scripts/trl_table.py"
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "| `use_vllm` | refused (`false` accepted) | generation runs on the JAX sampler" in readme
    assert "| `use_vllm` | accepted: true, false | generation always runs on the JAX sampler" in readme  # GRPO's


# ------------------------------------------------------------------------------------------------ PPO (TRL 1.12)
def _trl112_ppo_options() -> set[str]:
    """Every option of TRL 1.12's PPO: PPOConfig (its own fields, its base config's, transformers'
    TrainingArguments), and ppo_tldr.py's ModelConfig and ScriptArguments (vendored: tests/test_ppo_math.py checks
    the list against the release)."""
    import transformers

    from tests import ppo_trl112_fields as v

    return ({n for n, _, _ in v.PPO_CONFIG_FIELDS} | {n for n, _, _ in v.BASE_CONFIG_FIELDS}
            | {f.name for f in dataclasses.fields(transformers.TrainingArguments)} | set(v.MODEL_CONFIG_FIELDS)
            | set(v.SCRIPT_ARGUMENTS_FIELDS))


PPO_REQUIRED = ["ppo", "--model_name_or_path", "m", "--dataset_name", "d", "--reward_model_path", "rm"]


def test_every_trl112_ppo_option_has_a_decision():
    from rloo_jax.algorithms import PPOConfig
    PPO_DECISIONS = PPOConfig.TRL_OPTIONS

    options = _trl112_ppo_options()
    assert len(options) >= 160
    assert sorted(options - set(PPO_DECISIONS)) == [], "decide these TRL 1.12 PPO options in rloo_jax/trl_options.py"
    assert sorted(set(PPO_DECISIONS) - options) == [], "not TRL 1.12 PPO options"
    fields = set(field_names(PPOConfig))
    for name, decision in PPO_DECISIONS.items():
        if name == "max_grad_norm":  # a shared field PPO fixes at 0: TRL 1.12's PPO never clips (read, no effect)
            assert decision.status == "accepted" and PPOConfig(device_count=1, process_count=1).max_grad_norm == 0
            continue
        assert (decision.status == "supported") == (name in fields), name


def test_trl112_ppo_defaults_ask_for_nothing_refused():
    """TRL 1.12 PPOConfig's own defaults (vendored reprs) pass; so do transformers' for the rest."""
    import ast

    import transformers

    from rloo_jax.algorithms import PPOConfig
    from tests import ppo_trl112_fields as v
    PPO_DECISIONS = PPOConfig.TRL_OPTIONS

    defaults = {n: ast.literal_eval(d) for n, _, d in v.PPO_CONFIG_FIELDS + v.BASE_CONFIG_FIELDS}
    defaults.update({n: d for n, d in trl_defaults(transformers.TrainingArguments).items() if n not in defaults})
    for name, default in defaults.items():
        if PPO_DECISIONS[name].status != "supported":
            split_options({name: default}, field_names(PPOConfig), PPO_DECISIONS)
    # our PPOConfig keeps TRL 1.12's defaults of the PPO knobs (max_grad_norm and logging_steps aside: TRL ignores
    # both in PPO, docs/trl_options.md) and response_length as max_completion_length
    ours = PPOConfig(output_dir="o", device_count=1, process_count=1)
    for name, _, value in v.PPO_CONFIG_FIELDS:
        value = ast.literal_eval(value)
        # TRL's model paths default to example placeholders (EleutherAI/pythia-160m): None here
        if name in field_names(PPOConfig) and name not in ("logging_steps", "output_dir", "bf16", "max_grad_norm",
                                                           "gradient_checkpointing", "sft_model_path",
                                                           "reward_model_path"):
            assert getattr(ours, name) == value, name
    assert ours.max_completion_length == defaults["response_length"] == ours.response_length


def test_trl_ppo_tldr_command_line_loads(tmp_path, caplog):
    """TRL's ppo_tldr.py command line (its docstring's), as YAML: every option taken or decided."""
    from rloo_jax.algorithms import PPOConfig

    path = tmp_path / "tldr.yaml"
    path.write_text(
        "dataset_name: trl-lib/tldr\ndataset_test_split: validation\nlearning_rate: 3.0e-6\noutput_dir: out\n"
        "per_device_train_batch_size: 1\ngradient_accumulation_steps: 64\ntotal_episodes: 30000\n"
        "model_name_or_path: EleutherAI/pythia-1b-deduped\n"
        "sft_model_path: cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr\n"
        "reward_model_path: cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr\nmissing_eos_penalty: 1.0\n"
        "stop_token: eos\nresponse_length: 53\neval_strategy: steps\neval_steps: 100\nmax_grad_norm: 1.0\n"
        "local_rollout_forward_batch_size: 16\nnum_sample_generations: 10\n")
    with caplog.at_level(logging.WARNING, logger="rloo_jax"):
        cfg = load_config(["ppo", "--config", str(path)])
    assert isinstance(cfg, PPOConfig)
    assert (cfg.policy_path, cfg.tokenizer_path, cfg.resolved_value_model_path) == (
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr", "EleutherAI/pythia-1b-deduped",
        "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr")
    assert (cfg.max_completion_length, cfg.max_grad_norm, cfg.generation_batch_size, cfg.eval_steps) == (53, 0.0, 64,
                                                                                                       100)
    assert cfg.total_steps(116722) == 469  # TRL's num_total_batches: ceil(30000 / 64)
    assert "max_grad_norm=1.0 has no effect" in caplog.text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--response_length", "0"], r"response_length \(max_completion_length\) must be >= 1"),
        (["--beta", "0.1"], "beta is not a PPO option .PPO's KL coefficient is kl_coef"),
        (["--num_generations", "2"], "num_generations is not a PPO option"),
        (["--stop_token", "eos", "--stop_token_id", "3"], "set stop_token or stop_token_id, not both"),
        (["--gradient_accumulation_steps", "3", "--num_mini_batches", "2", "--per_device_train_batch_size", "2"],
         r"num_mini_batches \(2\) must divide gradient_accumulation_steps \(3\) or be a multiple of it"),
        (["--whiten_rewards", "true"], "whiten_rewards needs at least 8 rows per mini-batch"),
        (["--kl_estimator", "k2"], "kl_estimator: 'k2' is not one of k1, k3"),
        (["--model_adapter_name", "a"], "model_adapter_name='a' is not supported here"),
    ],
)
def test_bad_ppo_options_exit_2(args, message, tmp_path, capsys):
    argv = [*PPO_REQUIRED, "--per_device_train_batch_size", "2", *args, "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_ppo_needs_a_value_model(tmp_path, capsys):
    argv = ["ppo", "--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "pkg.mod:f",
            "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: PPO needs a value model: set --value_model_path"), err
