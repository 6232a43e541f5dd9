"""Model FLOPs, the decode floor and the roofline (`rloo_jax.efficiency`): goldens worked out by hand."""

import math

import pytest

from rloo_jax.efficiency import (
    Transformer,
    attention_kernel_flops,
    block_sparse_pairs,
    causal_pairs,
    forward_flops,
    roofline_seconds,
    rows_move,
    weights_stay,
)
from rloo_jax.models.config import config_from_hf
from tests.test_compile_only import TINY_LLAMA as TINY  # D 64, 2 layers, 4 heads of 16, 2 kv, MLP 128, V 160


def brute_pairs(start, count, window=None):
    return sum(min(i + 1, window or i + 1) for i in range(start, start + count))


@pytest.mark.parametrize(
    "start, count, window",
    [(0, 4, None), (2, 2, None), (0, 4, 2), (3, 5, 4), (6, 3, 4), (0, 1, 1), (5, 0, None), (10, 7, 12)],
)
def test_causal_pairs(start, count, window):
    assert causal_pairs(start, count, window) == brute_pairs(start, count, window)


def test_block_sparse_kernel_pairs_and_flops_by_hand():
    """A flash kernel computes every (query block, key block) the causal mask touches, whole. By hand on the grid:
    2 x 2 blocks of 128 -> the two diagonal ones and the one below; a query block at offset 256 over 3 key blocks
    sees all 3, with a window of 128 the last 2; 512 queries in 128-blocks over 256-wide key blocks: 1, 1, 2, 2."""
    assert block_sparse_pairs(256, 256, 128, 128) == 3 * 128**2
    assert block_sparse_pairs(128, 384, 128, 128, offset=256) == 3 * 128**2
    assert block_sparse_pairs(128, 384, 128, 128, offset=256, window=128) == 2 * 128**2
    assert block_sparse_pairs(512, 512, 128, 256) == (1 + 1 + 2 + 2) * 128 * 256
    assert block_sparse_pairs(1024, 1024, 512, 512, window=100) == 3 * 512**2  # the diagonal and one below
    # a plain Python loop over every pair, as the oracle: a block counts if any of its pairs is visible
    for q_len, kv_len, bq, bkv, offset, window in [(256, 384, 128, 128, 128, None), (384, 512, 128, 256, 0, 200)]:
        seen = 0
        for qb in range(q_len // bq):
            for kb in range(kv_len // bkv):
                seen += any(0 <= t + offset - s < (window or 10**9) for t in range(qb * bq, (qb + 1) * bq)
                            for s in range(kb * bkv, (kb + 1) * bkv))
        assert block_sparse_pairs(q_len, kv_len, bq, bkv, offset, window) == seen * bq * bkv
    assert attention_kernel_flops(2, 3, 4, 5) == 4 * 2 * 3 * 4 * 5 == 480.0


def test_forward_flops_and_roofline_examples():
    assert forward_flops(10, 2, 6, 4, tokens=3, scored=2, pairs=6) == 2 * (2 * 10 * 3 + 6 * 2) + 4 * 2 * 4 * 6 == 336
    assert roofline_seconds((4e12, 1e9), (2e12, 1e9)) == 2.0
    assert roofline_seconds((1.0, 5.0), (1.0, math.nan)) == 1.0  # an unpublished rate is left out
    assert math.isnan(roofline_seconds((math.nan, 1.0), (1.0, 1.0)))


def test_model_flops_of_the_tiny_llama_by_hand():
    t = Transformer.of(config_from_hf(TINY))
    # per layer: q 64x64 + k, v 64x32 + o 64x64 = 12288; gate, up, down 3 x 64 x 128 = 24576
    assert (t.layer_params, t.num_layers, t.unembed_params) == (36864, 2, 10240)
    assert (t.attention_width, t.kv_width) == (64, 32)
    assert t.matmul_params == 2 * 36864 + 10240
    # B = 8 prompts of P = 16, G = 4, C = 32: tokens 8 * 16 + 32 * 32 = 1152, 1024 scored; query-key pairs
    # 8 * (16 * 17 / 2) + 32 * (32 * 16 + 32 * 33 / 2) = 1088 + 33280
    assert t.batch_forward(8, 16, 4, 32) == 2 * (2 * 36864 * 1152 + 10240 * 1024) + 4 * 2 * 64 * 34368 == 208437248
    # prefill: 128 tokens, 8 scored, 1088 pairs; 31 decode steps of 32 rows at positions 16..46 (keys 17..47)
    prefill = 2 * (2 * 36864 * 128 + 10240 * 8) + 4 * 2 * 64 * 1088
    decode = 2 * (2 * 36864 + 10240) * 32 * 31 + 4 * 2 * 64 * 32 * (17 + 47) * 31 // 2
    assert t.sampling(8, 16, 4, 32) == prefill + decode == 19595264 + 182845440
    # caches: k and v, 2 layers x 32 per token, f32: 8 x 16 prompt tokens + 32 x 32 generated slots
    assert t.kv_cache_bytes(8, 16, 4, 32, 4) == 2 * 2 * 32 * 4 * 1152 == 589824


def test_model_flops_of_gpt_neox_and_sliding_windows():
    neox = dict(
        TINY,
        architectures=["GPTNeoXForCausalLM"],
        model_type="gpt_neox",
        rotary_pct=0.25,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        num_key_value_heads=4,
    )
    t = Transformer.of(config_from_hf(neox))
    assert t.layer_params == 4 * 64 * 64 + 2 * 64 * 128  # q, k, v, o + up and down (no gate)
    mistral = dict(TINY, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    w = Transformer.of(config_from_hf(mistral))
    assert w.window == 8
    full = Transformer.of(config_from_hf(TINY))
    assert full.batch_forward(1, 16, 2, 16) - w.batch_forward(1, 16, 2, 16) == 4 * 2 * 64 * (
        brute_pairs(0, 16) + 2 * brute_pairs(16, 16) - brute_pairs(0, 16, 8) - 2 * brute_pairs(16, 16, 8)
    )
    # Gemma 2: layer 0 windowed, layer 1 global: half the layers save what Mistral's two save
    gemma = dict(TINY, architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=8, head_dim=16)
    gw = Transformer.of(config_from_hf(gemma))
    assert (gw.window, gw.windows) == (None, (8, None)) and gw.layer_params == full.layer_params  # gated MLP too
    assert gw.layer_pairs(16, 16) == brute_pairs(16, 16, 8) + brute_pairs(16, 16)
    assert full.batch_forward(1, 16, 2, 16) - gw.batch_forward(1, 16, 2, 16) == 4 * 64 * (
        brute_pairs(0, 16) + 2 * brute_pairs(16, 16) - brute_pairs(0, 16, 8) - 2 * brute_pairs(16, 16, 8)
    )
    assert full.sampling(1, 16, 2, 16) - gw.sampling(1, 16, 2, 16) == 4 * 64 * (
        brute_pairs(0, 16) + 2 * brute_pairs(16, 15) - brute_pairs(0, 16, 8) - 2 * brute_pairs(16, 15, 8)
    )
    # Phi-3: the fused qkv_proj / gate_up_proj hold the same matrices
    phi3 = dict(TINY, architectures=["Phi3ForCausalLM"], model_type="phi3")
    assert Transformer.of(config_from_hf(phi3)).layer_params == full.layer_params


def test_a_mixture_of_experts_counts_the_experts_a_token_uses():
    """A routed block's FLOPs count its router and the K experts a token goes through (the active parameters), not
    all E; its bytes, the experts a step's rows can reach. By hand: D 8, 2 heads of 4 (1 kv), a dense first block
    (MLP 16) and a routed second one (4 experts of 6, 2 a token), V 10: attention 64 + 32 + 32 + 64 = 192, the dense
    MLP 3 x 8 x 16 = 384, an expert 3 x 8 x 6 = 144, the router 8 x 4 = 32; blocks 576 and 192 + 32 + 2 x 144 =
    512, mean 544; all parameters 576 + 192 + 32 + 4 x 144 + 80 = 1456."""
    moe = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, moe_intermediate_size=6,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
               num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=32, tie_word_embeddings=False)
    t = Transformer.of(config_from_hf(moe))
    assert (t.layer_params, t.matmul_params) == (544, 1456)
    assert t.weight_bytes(2) == 2 * 1456  # every expert
    assert t.weight_bytes(2, rows=1) == 2 * (1456 - 2 * 144)  # one row reaches 2 experts of the routed block's 4
    assert t.weight_bytes(2, rows=2) == 2 * 1456
    # what a decode step's rows can move to on an FSDP mesh besides the head: all but the experts, 576 + 192 + 32
    assert t.split_bytes(2) == 2 * 800
    assert (t.expert_read_bytes(2, rows=1), t.expert_read_bytes(2)) == (2 * 2 * 144, 4 * 2 * 144)  # 1 routed block
    assert forward_flops(t.layer_params, 2, 80, 8, tokens=3, scored=1, pairs=0) == 2 * (2 * 544 * 3 + 80)


def test_rows_move_to_experts_split_over_fsdp_when_their_partial_sums_are_smaller():
    """`rows_move`: pairs x 2F x 4 bytes of partial sums against 3 E D F x itemsize of experts (F cancels). By hand
    for E 4, D 24, float32: 3 x 4 x 24 x 4 = 1,152 bytes a unit of F; 143 pairs x 8 = 1,144 moves, 144 (1,152) does
    not. Qwen3-30B-A3B (E 128, D 2048, bf16: 1,572,864): a decode step's 256 rows x 8 = 2,048 pairs move, a training
    micro-batch's 8 x 1,280 tokens x 8 chips x 8 = 655,360 pairs do not."""
    assert rows_move(143, 4, 24, 4) and not rows_move(144, 4, 24, 4)
    assert rows_move(2048, 128, 2048, 2) and not rows_move(655360, 128, 2048, 2)


def test_rows_move_to_a_matrix_split_over_fsdp_when_a_device_receives_fewer_bytes():
    """`weights_stay` against gathering [64, 64] in bf16 over 4 devices (8,192 bytes). On din: the rows' hidden
    units exchanged (64 x 2 / 4 = 32 bytes a row) and their float32 partial sums (64 x 4 = 256): 28 x 288 = 8,064
    move, 29 (8,352) do not. On dout: the rows gathered (128 a row) and a quarter of their float32 columns (64):
    42 x 192 = 8,064 move, 43 (8,256) do not."""
    assert weights_stay(28, 64, 64, 2, 0, 4) and not weights_stay(29, 64, 64, 2, 0, 4)
    assert weights_stay(42, 64, 64, 2, 1, 4) and not weights_stay(43, 64, 64, 2, 1, 4)
    # gpt-oss-20b's q [2880, 4096] on a v5e-8: 256 decode rows x (720 + 16,384) against 23.6M
    assert weights_stay(256, 2880, 4096, 2, 0, 8) and not weights_stay(8192, 2880, 4096, 2, 0, 8)
