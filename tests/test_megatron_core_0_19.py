"""The Megatron integration tests again on megatron-core 0.19.1, the GPU machines' version.

The GPU machines run megatron-core 0.19 (Python >= 3.12), whose batch split dispatches THD
batches to the per-document split, whose RoPE takes more arguments and whose optimizer and
checkpoint code differ from the 0.16 installed here. The files below run again, in one
subprocess, on megatron-core 0.19.1 from the Megatron-LM tree (core_r0.19.0) on this Python
(with the one shim its imports need on Python 3.11: ``typing.override``). One subprocess for
all of them: the tree is unpacked, and pytest, torch and megatron-core are imported, once.
Skips without the tarball (``megatron_lm_tree``).
"""

import os

from megatron_lm_tree import rerun_on_megatron_core_0_19

TESTS = os.path.dirname(os.path.abspath(__file__))
FILES = ["test_megatron_packed.py", "test_megatron_pipeline.py", "test_megatron_tp.py",
         "test_resume_distrib_optimizer.py"]


def test_megatron_files_pass_on_megatron_core_0_19(tmp_path):
    rerun_on_megatron_core_0_19([os.path.join(TESTS, name) for name in FILES], tmp_path)
