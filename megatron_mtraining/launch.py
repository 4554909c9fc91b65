"""``python -m megatron_mtraining.launch``: the launcher, kept under its published name.

The launcher lives in ``megatron_mtraining.integration.launch`` with the rest of the Megatron
integration; this module is its alias (same ``main``, ``run`` and ``LaunchError``).
"""

from .integration.launch import LaunchError, main, run

__all__ = ["LaunchError", "main", "run"]

if __name__ == "__main__":
    main()
