"""The agreement's former home: it moved to ``collective/agreement.py`` (the approximator shares it,
below the ring's layer). This name stays importable and IS that module (not a copy of its names),
so code that patches ``megatron_mtraining.ring.agreement.agree`` patches what the ring calls."""

import sys

from ..collective import agreement as _agreement

sys.modules[__name__] = _agreement
