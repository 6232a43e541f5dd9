"""Parity with TRL 1.16's own GRPOTrainer code path on a tiny local model, for every loss_type.

A real ``trl.GRPOTrainer`` is fed fixed completions (its generation backend is replaced, nothing else); its scoring
(``_generate_and_score_completions``: advantages, reward metrics) and loss (``_compute_loss``: the loss_type, the
masks, the KL term, the entropy bonus, its logged metrics) are compared with ``GRPO.score`` and ``GRPO.loss`` fed
the same per-token log-probs, entropies and rewards. Off-policy cases (steps_per_generation 2: TRL recomputes the
old log-probs) perturb the policy between scoring and the loss, so ratios move off 1 and clipping fires.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import jax.numpy as jnp  # noqa: E402
from datasets import Dataset  # noqa: E402

import rloo_jax as rj  # noqa: E402
from tests.test_trl_parity import COMPLETIONS, EOS, PAD, PROMPTS, _perturb, _tokenizer  # noqa: E402

pytestmark = pytest.mark.parity

C, G, B = 6, 4, 8

# every loss_type, on and off policy, with the options that change the path: the KL term (with and without the
# bias correction), entropy masks and bonuses (static and adaptive), delta, sequence-level ratios, the off-policy
# mask, GDPO's aggregation, batch scaling, None rewards, truncated completions masked
CASES = {
    "grpo_on_beta": dict(loss_type="grpo", beta=0.05),
    "dapo_off_topentropy_masktrunc": dict(loss_type="dapo", beta=0.1, epsilon_high=0.28, top_entropy_quantile=0.5,
                                          mask_truncated_completions=True, off=True),
    "dr_grpo_off_scale_none": dict(loss_type="dr_grpo", scale_rewards="none", epsilon=0.05, off=True),
    "bnpo_off_sequence_level": dict(loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.02, off=True),
    "cispo_off": dict(loss_type="cispo", epsilon_high=1.02, beta=0.02, off=True),
    "sapo_off": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3, off=True),
    "luspo_off_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.02, off=True),
    "vespo_off": dict(loss_type="vespo", off=True),
    "grpo_off_delta_opsm_nobias": dict(loss_type="grpo", delta=1.02, epsilon=0.01, off_policy_mask_threshold=0.001,
                                       beta=0.1, use_bias_correction_kl=False, off=True),
    "dapo_entropy_bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "dapo_adaptive_entropy_off": dict(loss_type="dapo", entropy_coef=0.05, use_adaptive_entropy=True,
                                      entropy_target=10.0, off=True),
    "gdpo_batch_nan": dict(loss_type="grpo", multi_objective_aggregation="normalize_then_sum", beta=0.05,
                           rewards="two"),
    "batch_scale_nan": dict(loss_type="dapo", scale_rewards="batch", rewards="two"),
}
ONE = [[1.0], [0.0], [0.5], [2.0], [1.0], [1.0], [0.3], [0.7]]
TWO = [[1.0, 0.2], [None, None], [0.5, 1.0], [2.0, None], [1.0, 0.0], [3.0, -1.0], [0.3, 0.3], [None, 2.0]]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=PAD,
        eos_token_id=EOS, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("grpo_tiny")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _run_trl(path, tmp_path, spec):
    spec = dict(spec)
    off, rewards = spec.pop("off", False), TWO if spec.pop("rewards", "one") == "two" else ONE
    tables = [list(col) for col in zip(*rewards, strict=True)]

    def make(i):
        def func(prompts, completions, completion_ids, **kwargs):
            return tables[i]

        func.__name__ = f"r{i}"
        return func

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=B // (2 if off else 1), num_generations=G,
        max_completion_length=C, report_to=[], use_cpu=True, bf16=False, logging_steps=1, seed=0,
        steps_per_generation=2 if off else 1, temperature=0.8, **spec,
    )
    trainer = trl.GRPOTrainer(
        model=path, reward_funcs=[make(i) for i in range(len(tables))], args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # (set by the Trainer's loop)
    _perturb(trainer.model, seed=2, scale=0.1)  # policy != reference: the KL term is not zero
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in COMPLETIONS], None)
    out = trainer._generate_and_score_completions([{"prompt": PROMPTS[i // G]} for i in range(B)])
    score_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert ("old_per_token_logps" in out) == off  # TRL's rule: recomputed off-policy only
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        if off:
            _perturb(trainer.model, seed=1, scale=0.08)
        cur, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, C, compute_entropy=True)
    trainer._metrics["train"].clear()
    loss = float(trainer._compute_loss(trainer.model, out))
    as_np = lambda t: t.detach().float().numpy()  # noqa: E731
    return dict(out={k: as_np(v) for k, v in out.items() if isinstance(v, torch.Tensor)}, cur=as_np(cur),
                ent=as_np(ent), loss=loss, metrics={k: v[-1] for k, v in trainer._metrics["train"].items()},
                score_metrics=score_metrics, rewards=rewards, off=off)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_grpo(case, tiny_model_dir, tmp_path):
    spec = CASES[case]
    run = _run_trl(tiny_model_dir, tmp_path, spec)
    out, off = run["out"], run["off"]
    opts = {k: v for k, v in spec.items() if k not in ("off", "rewards")}
    algo = rj.GRPO(max_completion_length=C, **opts)
    mask = out["completion_mask"].astype(np.float32)
    rewards = jnp.asarray([[np.nan if r is None else r for r in row] for row in run["rewards"]], jnp.float32)
    weights = jnp.ones(rewards.shape[1])

    # 1. advantages and the scoring metrics (TRL names the functions r0, r1)
    targets, sm = algo.score(rj.ScoreInputs(rewards, weights, jnp.asarray(mask), None, None, None,
                                            num_generations=G))
    np.testing.assert_allclose(targets["advantages"], out["advantages"], atol=1e-5)
    names = [("reward", "reward"), ("reward_std", "reward_std"), ("frac_reward_zero_std", "frac_reward_zero_std")]
    names += [(f"rewards/{i}/{s}", f"rewards/r{i}/{s}") for i in range(rewards.shape[1]) for s in ("mean", "std")]
    for ours, theirs in names:
        assert float(sm[ours]) == pytest.approx(run["score_metrics"][theirs], abs=1e-5), ours

    # 2. the loss and its metrics on the same per-token log-probs and entropies
    old = out["old_per_token_logps"] if off else run["cur"]
    num_items = float(out["num_items_in_batch"]) / (2 if off else 1)  # / steps_per_generation
    inputs = rj.LossInputs(
        logps=jnp.asarray(run["cur"]), entropy=jnp.asarray(run["ent"]), old_logps=jnp.asarray(old),
        mask=jnp.asarray(mask), advantages=jnp.asarray(out["advantages"]),
        ref_logps=None if algo.beta == 0 else jnp.asarray(out["ref_per_token_logps"]),
        num_items=jnp.asarray(num_items), algo_state=algo.init_state(),
    )
    loss, metrics, stats = algo.loss(inputs)
    assert float(loss) == pytest.approx(run["loss"], abs=1e-5, rel=1e-4)
    theirs = run["metrics"]
    expected = {k for k in theirs if k not in ("entropy", "entropy_coef")}
    assert expected <= set(metrics), sorted(expected - set(metrics))
    for name in expected:
        want = theirs[name]
        got = float(metrics[name])
        if want is None or np.isnan(want):
            assert np.isnan(got), name
        else:
            assert got == pytest.approx(want, abs=1e-5, rel=1e-4), name
    assert float(rj.masked_mean(jnp.asarray(run["ent"]), jnp.asarray(mask))) == pytest.approx(theirs["entropy"],
                                                                                              abs=1e-5)
    # entropy_coef: TRL logs it in _compute_loss at the optimizer step's end (after the adaptive update); ours comes
    # from the step's end too, GRPO.next_state over the step's entropy statistics (here one micro-batch). Float32
    # against TRL's Python float: measured 7.5e-10 (0.05), 3.0e-10 (0.055); a wrong branch is 0.005 off
    assert ("entropy_coef" in theirs) == algo.entropy_bonus
    if algo.entropy_bonus:
        _, step_metrics = algo.next_state(algo.init_state(), stats)
        assert float(step_metrics["entropy_coef"]) == pytest.approx(theirs["entropy_coef"], abs=1e-8)
        if algo.use_adaptive_entropy:  # the entropy (2.60 nats) is below the target 10: the coefficient went up
            assert theirs["entropy_coef"] == pytest.approx(spec["entropy_coef"] + algo.entropy_coef_delta)
    if off:
        assert abs(run["loss"]) > 1e-4  # the ratio really moved
    if "clip_ratio/region_mean" in theirs and spec.get("epsilon", 0.2) < 0.1:
        assert theirs["clip_ratio/region_mean"] > 0  # and clipping fired

