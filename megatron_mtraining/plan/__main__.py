"""``python -m megatron_mtraining.plan --help``."""

import sys

from .cli import main

sys.exit(main())
