"""Test-wide settings: no hub lookups (the network is closed), deterministic CPU jax."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Session-scoped tiny offline checkpoints (built once per test session), usable from every test module.
pytest_plugins = ["tests.fixtures_models"]
