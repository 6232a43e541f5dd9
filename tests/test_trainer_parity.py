"""Whole-trainer parity with TRL 1.16 (tests/trainer_parity.py): the same tiny model, prompts and rewards through
TRL's trainer and ours, greedy sampling, 8 optimizer steps, record by record. CI runs every GRPO loss type off-policy
(grpo on-policy too: whole groups, the gradient from the KL term and the entropy bonus), with and without a
reference model (beta 0: TRL's default loads none), the adaptive entropy controller (its `entropy_coef` compared per
step), RLOO off-policy (KL in the reward), GRPO and RLOO with optimizer steps spanning two generation batches
(steps_per_generation 3, gradient_accumulation_steps 2, ending inside a generation batch), RLOO stopping inside a
generation batch at max_steps, RLOO given a PeftModel, and GRPO on two devices (a subprocess with forced CPU devices)
against the same TRL run. bench/bench_trl_parity.py runs every loss type on policy as well."""

import os

import pytest

pytest.importorskip("trl")

from tests import trainer_parity as tp  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.slow]

CASES = {
    "grpo_dapo_off_policy_beta": ("grpo", dict(loss_type="dapo", beta=0.04)),
    "grpo_on_policy_kl_entropy": ("grpo", dict(loss_type="grpo", beta=0.04, entropy_coef=0.01,
                                               gradient_accumulation_steps=4, by_position=False)),
    "rloo_off_policy": ("rloo", dict(beta=0.05)),
    # steps_per_generation 3, gradient_accumulation_steps 2: step 2 holds generation 0's last micro-batch and
    # generation 1's first; max_steps 4 ends inside generation 2 (after 2 of its 3 micro-batches). One prompt of 6
    # completions per generation, 2 per micro-batch: no optimizer step holds a whole group (whose greedy, identical
    # completions cancel the policy gradient to float noise that Adam blows up to learning-rate-sized steps)
    "grpo_dapo_step_spans_generations": ("grpo", dict(loss_type="dapo", beta=0.04, num_generations=6,
                                                      steps_per_generation=3, gradient_accumulation_steps=2,
                                                      max_steps=4)),
    "rloo_step_spans_generations": ("rloo", dict(beta=0.05, num_generations=6, steps_per_generation=3,
                                                 gradient_accumulation_steps=2, max_steps=4)),
    # max_steps 6 with 4 optimizer steps per generation: the second generation runs 2 of its 4 (TRL stops exactly)
    "rloo_stops_inside_a_generation": ("rloo", dict(beta=0.05, max_steps=6)),
    # every other loss type, off-policy (ratios move from 1 after the first micro-batch of a generation); beta 0 is
    # TRL's default (no reference model loaded, no KL term)
    "grpo_dr_grpo_off_policy_beta": ("grpo", dict(loss_type="dr_grpo", beta=0.04)),
    # the adaptive entropy controller (Skywork-OR1): entropy_coef moves by 0.005 after every optimizer step (down
    # while the step's entropy is above entropy_target, up below it) and the bonus applies only after a step whose
    # entropy was <= entropy_target. TRL's entropies of this run: 3.0080, 3.0168, 3.2691, 3.2766 (coef 0.01 -> 0.005
    # -> 0 -> 0 -> 0), then 2.8607, 2.9742, 2.9140, 2.9770 (-> 0.005 -> 0.01 -> 0.015 -> 0.02; the bonus on in steps
    # 6-8): every one at least 0.008 from the target 3.0 (the two sides' entropies: 4.8e-6 apart), so both take the
    # same branches. Ours keeps the coefficient in float32 (TRL: a Python float): 4.5e-10 apart; a wrong branch: 0.005
    "grpo_bnpo_off_policy_adaptive_entropy": ("grpo", dict(loss_type="bnpo", beta=0.04, entropy_coef=0.01,
                                                           use_adaptive_entropy=True, entropy_target=3.0)),
    "grpo_cispo_off_policy_no_reference": ("grpo", dict(loss_type="cispo", beta=0.0)),
    "grpo_sapo_off_policy_no_reference": ("grpo", dict(loss_type="sapo", beta=0.0)),
    "grpo_luspo_off_policy_sequence_level": ("grpo", dict(loss_type="luspo", beta=0.04,
                                                          importance_sampling_level="sequence")),
    # vespo's loss, -phi(w) A logp (the raw log-probs, not a ratio near 1, times Gamma weights of the sequence's summed
    # log-ratio), carries the float noise of the weights much further than the other losses: measured ours vs TRL
    # 8.2e-6 abs (2.4e-5 rel) at step 6, dapo 2.3e-6; TRL against itself from initial weights 1 float32 ulp apart
    # (x (1 + 2^-24 N(0, 1))): vespo 7.5e-6 (step 7), dapo 6.6e-7. On the same inputs (tests/test_grpo_parity.py)
    # the two losses agree to 3e-8, both within 2e-8 of float64: the difference is TRL's own float noise, not ours
    "grpo_vespo_off_policy_beta": ("grpo", dict(loss_type="vespo", beta=0.04)),
    # a PeftModel with non-zero adapters: TRL's reference is a frozen copy of the starting adapters (not the base; with
    # it the kl of step 1 is 0 on both sides). lr 5e-4: at 2e-3 the moved adapters clip every token of step 3's
    # micro-batch (grad_norm 0.0 on both sides)
    "rloo_peft_model_reference": ("rloo", dict(beta=0.05, peft_model=True, learning_rate=5e-4)),
}
# float32 on both sides, 8 steps at lr 2e-3: measured worst 4.5e-6 abs on the losses, 1e-4 rel on grad norms
# (2.7e-4 on 2.34 after 8 steps at lr 5e-3), 7e-5 on the final weights
TOLERANCE = dict(abs=1e-5, rel=1e-4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tp.build_model(str(tmp_path_factory.mktemp("parity") / "m"))


def options_of(case):
    kind, options = CASES[case]
    return kind, dict(dict(learning_rate=2e-3), **options)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """`runs(case, side)`: the case's TRL run ("trl") or our single-device one ("ours"), each made once for the
    module (the two-device test compares against both)."""
    made = {}

    def run(case, side):
        if (case, side) not in made:
            kind, options = options_of(case)
            out = tmp_path_factory.mktemp(f"{case}_{side}") / "out"
            made[case, side] = (tp.run_trl if side == "trl" else tp.run_ours)(kind, model_dir, str(out), **options)
            if side == "ours":
                assert os.path.isdir(out / "final")
        return made[case, side]

    return run


def assert_equal_runs(theirs, ours, steps):
    result = tp.compare(theirs, ours)
    assert result["steps"] == steps
    for name, (abs_diff, rel_diff) in result["metrics"].items():
        assert abs_diff <= TOLERANCE["abs"] or rel_diff <= TOLERANCE["rel"], (name, abs_diff, rel_diff)
    assert result["weights"] <= 1e-4
    records = [r for r in ours["records"] if r.get("grad_norm")]
    assert len(records) == steps and all(r["grad_norm"] > 1e-3 for r in records)  # real gradients at every step
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_equals_trl(case, runs):
    kind, options = options_of(case)
    result = assert_equal_runs(runs(case, "trl"), runs(case, "ours"), options.get("max_steps", 8))
    if options.get("use_adaptive_entropy"):  # the controller really moved, and TRL's and ours moved alike
        coefs = [r["entropy_coef"] for r in runs(case, "trl")["records"]]
        assert len(set(coefs)) >= 4 and min(coefs) == 0.0, coefs
        assert result["metrics"]["entropy_coef"][0] <= 1e-8


MESH_CASE = "grpo_bnpo_off_policy_adaptive_entropy"


def test_grpo_on_two_devices_equals_trl_and_one_device(runs, model_dir, tmp_path):
    """Our GRPOTrainer on 2 forced CPU devices (a subprocess): the mesh (data 1, fsdp 2) splits every micro-batch's
    2 completions and the weights over the devices (per_device_train_batch_size 1: TRL's micro-batch of 2), the
    update reduces the gradients, the KL and entropy statistics over them and keeps the entropy controller's state
    replicated. Its records and final weights equal TRL's run (TRL's tolerance) and our one-device run. (Greedy: a
    micro-batch's two rows are one prompt's identical completions, so the devices hold equal token counts.)"""
    kind, options = options_of(MESH_CASE)
    two = tp.run_ours_on_devices(2, kind, model_dir, str(tmp_path / "two"), ours=dict(per_device_train_batch_size=1),
                                 **options)
    assert_equal_runs(runs(MESH_CASE, "trl"), two, 8)
    # one device against two: the sharded matmuls sum in another order, and Adam carries that noise as it carries
    # torch's: measured 1.7e-6 on the losses, 1.1e-5 abs (2.3e-6 rel) on the grad norms, 1.6e-5 on the final weights,
    # as far apart as ours and TRL's; so the same tolerance
    assert_equal_runs(runs(MESH_CASE, "ours"), two, 8)
