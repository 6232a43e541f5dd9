"""Notices of libraries that are noise for rloo_jax, dropped by exact text. Imported first by `rloo_jax`.

transformers says "PyTorch was not found. Models won't be available ..." when it is imported without torch, which is
how rloo_jax uses it (tokenizers and configs only; the models are ours). The filter is on transformers' root logger
before any rloo_jax module imports transformers; every other transformers message, and every error, is left as is.
"""

import logging

TORCH_NOTICE = "PyTorch was not found"


def not_torch_notice(record: logging.LogRecord) -> bool:
    """False (drop) for transformers' no-PyTorch notice (a warning starting with TORCH_NOTICE), True for every
    other record (errors included)."""
    return record.levelno > logging.WARNING or not str(record.msg).startswith(TORCH_NOTICE)


if not_torch_notice not in logging.getLogger("transformers").filters:
    logging.getLogger("transformers").addFilter(not_torch_notice)
