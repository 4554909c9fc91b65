"""A Megatron run that starts from a converted checkpoint (``--pretrained-checkpoint CKPT``).

``check_pretrained_run(args)`` runs at MTraining's start-up (``integration.enable``), before the
model is built: when ``CKPT`` holds the converter's record (``mtraining_conversion.json``), it
compares the run's model flags with the checkpoint's shape and raises one ValueError naming every
disagreement (Megatron's own load would fail later, tensor by tensor); it then copies the record
(and the vocabulary rows it keeps) into ``--save``, so that the run's own checkpoints export
without ``--hf-base``.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from .pipeline import RECORD, TAIL, read_record
from .shape import ModelShape

__all__ = ["check_pretrained_run"]


def check_pretrained_run(args) -> Optional[dict]:
    """Returns the record of ``args.pretrained_checkpoint`` (None without one)."""
    source = getattr(args, "pretrained_checkpoint", None)
    if not source:
        return None
    record = read_record(source)
    if record is None:
        return None
    shape = ModelShape.from_json(record["shape"])
    problems = shape.check_megatron_args(args, padded_vocab=record["padded_vocab_size"])
    if problems:
        flags = " ".join(record["megatron_flags"])
        raise ValueError(f"--pretrained-checkpoint {source} was converted from a model these flags do not describe: "
                         + "; ".join(problems) + f". Its model flags: {flags}")
    save = getattr(args, "save", None)
    if save and int(getattr(args, "rank", 0) or 0) == 0 and os.path.abspath(save) != os.path.abspath(source):
        os.makedirs(save, exist_ok=True)
        for name in (RECORD, TAIL):
            if os.path.isfile(os.path.join(source, name)) and not os.path.exists(os.path.join(save, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(save, name))
    return record
