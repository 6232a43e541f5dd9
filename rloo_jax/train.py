"""`python -m rloo_jax.train [rloo|grpo|ppo] [--config FILE.yaml] [--name value ...]`: the command line
(`rloo_jax.cli`). Nothing imports this module; the training loop is `rloo_jax.loop`."""

import sys

from rloo_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
