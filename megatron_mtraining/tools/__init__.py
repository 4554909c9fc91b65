"""What runs around the library rather than in it: the end-to-end demo (``make demo``), the ring
check, the synthetic retrieval corpus that the quality benchmark trains on, and synthetic
vertical-slash q/k for the approximator's recall. Nothing in ``megatron_mtraining`` imports these."""
