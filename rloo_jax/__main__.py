"""`python -m rloo_jax` is `python -m rloo_jax.train`."""

import sys

from rloo_jax.train import main

sys.exit(main())
