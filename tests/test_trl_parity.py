"""Parity with TRL 1.16's own RLOOTrainer code path on a tiny local model.

We build a real ``trl.RLOOTrainer``, feed it fixed completions (its generation backend is replaced, nothing else),
run its scoring (``_generate_and_score_completions``) and loss (``_compute_loss``) and compare with our pure
functions fed the same per-token log-probs and rewards. Off-policy cases perturb the policy between scoring and
the loss, so the ratio is not 1 and clipping can fire.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import jax.numpy as jnp  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import rloo_jax as rj  # noqa: E402

pytestmark = pytest.mark.parity

VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(46)]
PAD, EOS = 0, 1
C = 6  # completion length
G = 4
B = 8  # completions per generation batch (2 prompts x G)


def _tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=PAD,
        eos_token_id=EOS, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("trl_tiny")
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


# Completions as TRL's backend returns them (cut after the first EOS); row 3 and row 6 hit the length limit.
COMPLETIONS = [
    [5, 9, EOS],
    [7, 7, 7, 3, EOS],
    [2, EOS],
    [4, 8, 15, 16, 23, 42],
    [11, 12, 13, EOS],
    [30, EOS],
    [20, 21, 22, 23, 24, 25],
    [5, 6, 7, 8, 9, EOS],
]
PROMPTS = ["w3 w4 w5 w6", "w10 w2"]


def _perturb(model, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _run_trl(path, tmp_path, *, rewards, off_policy, cfg):
    """TRL's scoring + loss on fixed completions; returns everything needed to compare with ours."""
    reward_tables = [list(col) for col in zip(*rewards, strict=True)]

    def make_func(i):
        def func(prompts, completions, completion_ids, **kwargs):
            return reward_tables[i]

        func.__name__ = f"r{i}"
        return func

    args = trl.RLOOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=G, max_completion_length=C,
        report_to=[], use_cpu=True, bf16=False, logging_steps=1, seed=0, **cfg,
    )
    trainer = trl.RLOOTrainer(
        model=path, reward_funcs=[make_func(i) for i in range(len(reward_tables))], args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=_tokenizer(),
    )
    trainer.model.train()
    _perturb(trainer.model, seed=2, scale=0.1)  # policy != reference, so the KL penalty is not zero
    trainer._generate_single_turn = lambda prompt_ids, images, mm: [list(c) for c in COMPLETIONS]
    out = trainer._generate_and_score_completions([{"prompt": PROMPTS[i // G]} for i in range(B)])
    score_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    c = out["completion_ids"].shape[1]
    with torch.no_grad():
        old_tok, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, c)
        ref_tok = None
        if trainer.beta != 0.0:
            ref_tok, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attn, c)
        if off_policy:
            _perturb(trainer.model, seed=1, scale=0.08)
        cur_tok, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, c, compute_entropy=True
        )
        # raw logits of the current policy at the completion positions, for our per_token_logps
        logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, -c - 1 : -1]
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, out)
    np_ = lambda t: None if t is None else t.detach().float().numpy()  # noqa: E731
    return dict(
        out={k: np_(v) for k, v in out.items() if isinstance(v, torch.Tensor)},
        old_tok=np_(old_tok), ref_tok=np_(ref_tok), cur_tok=np_(cur_tok), entropy=np_(ent), logits=np_(logits),
        loss=float(loss), metrics={k: v[-1] for k, v in trainer._metrics["train"].items()},
        score_metrics=score_metrics,
    )


CASES = {
    "beta_on_policy": dict(rewards=[[1.0], [0.0], [0.5], [2.0], [1.0], [1.0], [0.3], [0.7]], off_policy=False,
                           cfg=dict(beta=0.05)),
    "beta_clip_norm_offpolicy_T": dict(
        rewards=[[1.0, 0.2], [None, None], [0.5, 1.0], [2.0, None], [1.0, 0.0], [3.0, -1.0], [0.3, 0.3], [None, 2.0]],
        off_policy=True,
        cfg=dict(beta=0.2, reward_clip_range=(-0.5, 1.5), normalize_advantages=True, epsilon=0.1, epsilon_high=0.3,
                 temperature=0.7, reward_weights=[1.0, 0.5]),
    ),
    "mask_truncated_beta0_offpolicy": dict(
        rewards=[[1.0], [0.0], [0.5], [2.0], [1.0], [1.0], [0.3], [0.7]], off_policy=True,
        cfg=dict(beta=0.0, mask_truncated_completions=True, temperature=1.3),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_rloo(case, tiny_model_dir, tmp_path):
    spec = CASES[case]
    cfg = spec["cfg"]
    run = _run_trl(tiny_model_dir, tmp_path, rewards=spec["rewards"], off_policy=spec["off_policy"], cfg=cfg)
    out = run["out"]
    mask = out["completion_mask"]
    m = mask > 0
    temperature = cfg.get("temperature", 1.0)
    weights = cfg.get("reward_weights")
    weights = None if weights is None else jnp.asarray(weights)

    # 1. per-token log-probs and entropy from raw logits (TRL itself uses a fused lm-head kernel)
    cur = np.asarray(rj.per_token_logps(run["logits"], out["completion_ids"].astype(np.int32), temperature))
    np.testing.assert_allclose(cur[m], run["cur_tok"][m], atol=1e-5)
    ent = np.asarray(rj.entropy_from_logits(run["logits"], temperature))
    np.testing.assert_allclose(ent[m], run["entropy"][m], atol=1e-5)

    # 2. completion mask + truncation from the padded ids
    eos_mask, trunc = rj.completion_mask(jnp.asarray(out["completion_ids"]), (EOS,), PAD)
    want_trunc = np.array([c[-1] not in (EOS, PAD) for c in COMPLETIONS])
    np.testing.assert_array_equal(trunc, want_trunc)
    if cfg.get("mask_truncated_completions"):
        np.testing.assert_array_equal(np.asarray(eos_mask) * ~want_trunc[:, None], mask)
    else:
        np.testing.assert_array_equal(eos_mask, mask)

    # 3. generation-time scoring: advantages and TRL's logged scoring metrics
    rewards = jnp.asarray([[np.nan if r is None else r for r in row] for row in spec["rewards"]], jnp.float32)
    opts = rj.RLOOOptions(
        beta=cfg.get("beta", 0.05), epsilon=cfg.get("epsilon", 0.2), epsilon_high=cfg.get("epsilon_high"),
        normalize_advantages=cfg.get("normalize_advantages", False), reward_clip_range=cfg.get("reward_clip_range"),
        mask_truncated_completions=cfg.get("mask_truncated_completions", False),
    )
    ref = None if run["ref_tok"] is None else jnp.asarray(run["ref_tok"])
    adv, sm = rj.score_completions(
        rewards, jnp.asarray(mask), jnp.asarray(want_trunc), jnp.asarray(run["old_tok"]), ref,
        num_generations=G, reward_weights=weights, options=opts,
    )
    np.testing.assert_allclose(adv, out["advantages"], atol=1e-5)
    np.testing.assert_allclose((run["old_tok"] * mask).sum(1), out["old_logps"], atol=1e-5)
    names = [("reward", "reward"), ("reward_std", "reward_std"), ("frac_reward_zero_std", "frac_reward_zero_std")]
    names += [(f"rewards/{i}/{s}", f"rewards/r{i}/{s}") for i in range(rewards.shape[1]) for s in ("mean", "std")]
    if opts.beta:
        names.append(("kl", "kl"))
        assert abs(run["score_metrics"]["kl"]) > 1e-4  # the penalty is really exercised
    for ours, theirs in names:
        assert float(sm[ours]) == pytest.approx(run["score_metrics"][theirs], abs=1e-5), ours

    # 4. the loss and its metrics at the (possibly perturbed) current policy
    loss, lm = rj.clipped_objective(
        jnp.asarray(run["cur_tok"]), jnp.asarray(run["old_tok"]), adv, jnp.asarray(mask),
        epsilon=opts.epsilon, epsilon_high=opts.epsilon_high,
    )
    assert float(loss) == pytest.approx(run["loss"], abs=1e-5)
    for name in ["clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                 "clip_ratio/region_mean"]:
        assert float(lm[name]) == pytest.approx(run["metrics"][name], abs=1e-6), name
    assert float(rj.masked_mean(jnp.asarray(run["entropy"]), jnp.asarray(mask))) == pytest.approx(
        run["metrics"]["entropy"], abs=1e-5
    )
    if spec["off_policy"]:
        assert abs(run["loss"]) > 1e-3  # the ratio really moved
        if cfg.get("epsilon") == 0.1:
            assert run["metrics"]["clip_ratio/region_mean"] > 0  # and clipping fired

    # 5. rloo_loss end to end from the same inputs gives the same loss
    e2e_loss, _ = rj.rloo_loss(
        jnp.asarray(run["cur_tok"]), jnp.asarray(run["old_tok"]), ref, rewards, jnp.asarray(eos_mask),
        jnp.asarray(want_trunc), num_generations=G, reward_weights=weights, options=opts,
    )
    assert float(e2e_loss) == pytest.approx(run["loss"], abs=1e-5)
