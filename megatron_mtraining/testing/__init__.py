"""What the tests, the CPU demo (``examples/demo/``) and the benchmarks share; not the library.

* ``cpu_shims``: run megatron-core's model code on the CPU with gloo (never in a GPU run);
* ``gpt``: a small megatron-core GPT whose core attention is MTrainingAttention.

Nothing in the rest of ``megatron_mtraining`` imports these. They import megatron-core:
import the submodules explicitly.
"""
