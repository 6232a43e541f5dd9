"""`python -m rloo_jax` is `python -m rloo_jax.train`: the command line (`rloo_jax.cli`)."""

import sys

from rloo_jax.cli import main

sys.exit(main())
