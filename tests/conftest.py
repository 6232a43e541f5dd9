"""Test-wide settings: no hub lookups (the network is closed), deterministic CPU jax."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# GCS clients (gs:// tests against a local fake, tests/gcs.py) never look for credentials or probe a metadata
# server; gcsfs and google-auth read these once, at import
for _name, _value in {"FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                      "NO_GCE_CHECK": "true"}.items():
    os.environ.setdefault(_name, _value)

# Session-scoped tiny offline checkpoints (built once per test session), usable from every test module.
pytest_plugins = ["tests.fixtures_models"]
