"""What every computation over the context-parallel group shares, below the ring and the
approximator: the per-call agreement of the ranks' inputs (``agreement.py``) and the transport's
error and timeout (``transport.py``)."""
