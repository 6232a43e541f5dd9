"""Writes tests/data/bnb_quant.npz: a weight and bitsandbytes's quantizations of it (its CPU backend), the reference
tests/test_quant.py compares rloo_jax.quant with. bitsandbytes is not a dependency: run this once where it is
installed (0.50.2 wrote the file in the repository: `pip install bitsandbytes`, then, from the repository root,
`python scripts/bnb_quant_fixture.py`).
"""

import bitsandbytes as bnb
import bitsandbytes.functional as F
import numpy as np
import torch

rng = np.random.RandomState(0)
W = (rng.standard_normal((64, 128)) * 0.02).astype(np.float16)  # torch [out, in]
W[5] = 0  # an all-zero output row: zero scales
t = torch.tensor(W)
out = {"weight": W, "version": np.array(bnb.__version__)}
for qt in ("nf4", "fp4"):
    for nested in (False, True):
        q, st = F.quantize_4bit(t.float(), blocksize=64, quant_type=qt, compress_statistics=nested)
        out[f"{qt}{'_nested' if nested else ''}"] = F.dequantize_4bit(q, st, blocksize=64, quant_type=qt).numpy()
cb, scb, _ = F.int8_vectorwise_quant(t)
out["int8_codes"] = cb.numpy()
out["int8_absmax"] = scb.numpy()
np.savez_compressed("tests/data/bnb_quant.npz", **out)
print({k: (v.shape, v.dtype) for k, v in out.items()})
