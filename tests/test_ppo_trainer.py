"""PPO as a trainer (rloo_jax.PPOTrainer / `python -m rloo_jax.train ppo`): whole-trainer parity with TRL 1.12's
PPOTrainer (tests/ppo_parity.py), and the trainer's own contracts (bad inputs, exports)."""

from __future__ import annotations

import os

import pytest

from tests import ppo_parity as pp

pytest.importorskip("torch")

# 2 updates of tiny float32 models, greedy: the harness's cases. Each covers the code paths TRL handles differently:
# `eos_minibatches`: stop at EOS (responses cut, padding_mask_p1's extra position, the score one past the EOS),
# missing_eos_penalty, 2 PPO epochs x 2 mini-batches (the optimizer stepping across mini-batch boundaries, zero-
# diluted statistics tables), k1. `no_stop_k3_whiten`: no stop token (full-length responses, EOS anywhere), k3,
# whitened rewards (8 rows per mini-batch), gamma and lam below 1.
CASES = {
    "eos_minibatches": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
                            num_ppo_epochs=2, stop_token="eos", missing_eos_penalty=1.0, kl_estimator="k1",
                            kl_coef=0.2, cliprange=0.1, cliprange_value=0.05, vf_coef=0.3),
    "no_stop_k3_whiten": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1,
                              num_ppo_epochs=1, kl_estimator="k3", whiten_rewards=True, kl_coef=0.1, gamma=0.97,
                              lam=0.9),
}
COMMON = dict(response_length=6, temperature=1.0, learning_rate=1e-3, seed=5)
# float32 on both sides: measured worst 4.8e-7 abs over every logged metric of both cases (objective/entropy; ratios
# and approxkl at the 1e-13 float floor), final weights 1.4e-5 apart (AdamW's first steps turn float noise in
# near-zero gradients into lr-sized moves)
TOLERANCE = dict(abs=1e-5, rel=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not (pp.TRL112 / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        pytest.skip(f"TRL 1.12 side folder {pp.TRL112} is absent: run `make install-test` (or `pip install --no-deps "
                    f"--target {pp.TRL112} trl==1.12.0`)")
    return pp.build_models(str(tmp_path_factory.mktemp("ppo_models")))


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ppo_trainer_equals_trl112(case, models, tmp_path):
    options = {**COMMON, **CASES[case]}
    theirs = pp.run_trl(models, str(tmp_path / "trl"), options)
    ours = pp.run_ours(models, str(tmp_path / "ours"), options)
    # the same completions (greedy on both sides)
    stop = pp.EOS if options.get("stop_token") == "eos" else None
    trl_texts = [t for batch in theirs["completions"] for t in pp.completion_texts(batch, stop)]
    our_texts = [r["completion"] for r in ours["rollouts"]]
    assert our_texts == trl_texts
    result = pp.compare(theirs, ours)
    for name, (abs_diff, rel_diff) in result["metrics"].items():
        assert abs_diff <= TOLERANCE["abs"] or rel_diff <= TOLERANCE["rel"], (name, abs_diff, rel_diff)
    assert result["weights"] <= 1e-4, result["weights"]
    assert os.path.isdir(tmp_path / "ours" / "final_value")
