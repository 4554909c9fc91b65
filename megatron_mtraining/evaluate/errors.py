"""The one error type of the evaluation: bad input, with a message naming the problem and the fix."""

from __future__ import annotations

__all__ = ["EvaluationError"]


class EvaluationError(ValueError):
    """The evaluation cannot run as asked; the message says what is wrong and what to do."""
