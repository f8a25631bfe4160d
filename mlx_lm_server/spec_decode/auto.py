"""``--spec-decode auto`` (the default): prompt lookup, and the drafter the
model comes with.

A user should not have to know which drafter a checkpoint carries to get
it: Qwen3.5 / Qwen3-Next originals ship an MTP layer (``mtp.*``), a
grafted or split one sits inside the folder or beside it as ``NAME-mtp``
(``mlx-lm-server-models add-drafter``), and a head trained for the model
(``mlx-lm-server-drafter train``) or a draft model is given as
``--draft-model``. ``auto`` reads the folders' configs and tensor names (the
safetensors headers, no weights) once at start-up and picks the mix of
prompt lookup and that drafter, per row (``proposer/mixed.py``): code edits
keep what prompt lookup gives them, prose gets the drafter, and the
controller keeps any drafter that does not pay off. Without a drafter it is
``ngram``. What it chose and why is one line of the start-up log.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Optional

from .heads import drafter_config
from .heads.mtp import REQUIRED, dropped_layer_line, mtp_layer_count, nextn_prefix
from .proposer import DRAFT_MODEL, PROPOSERS


def tensor_names(folder: str) -> set[str]:
    """The names of the tensors in a folder's safetensors files, from their headers."""
    names = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names


def has_mtp_layer(folder: str) -> bool:
    """The checkpoint declares MTP layers and still holds their weights
    (mlx-lm's conversions keep the declaration and drop the weights):
    ``mtp.*``, or a DeepSeek-V3 / GLM-4.5 nextn layer."""
    try:
        config = drafter_config(folder)
    except ValueError:
        return False
    if mtp_layer_count(config) == 0:
        return False
    names = tensor_names(folder)
    nextn = nextn_prefix(config)
    return f"mtp.{REQUIRED[0]}" in names or (nextn is not None
                                               and f"{nextn}eh_proj.weight" in names)


def drafter_kind(folder: str) -> str:
    """What a ``--draft-model`` folder holds: the kind whose registration
    recognises its config (a head, a split MTP drafter), else a model of its
    own (``draft``)."""
    config = drafter_config(folder)
    recognised = (kind.name for kind in PROPOSERS.values()
                  if kind.recognises is not None and kind.recognises(config))
    model = next(kind.name for kind in PROPOSERS.values() if kind.drafts_with == DRAFT_MODEL)
    return next(recognised, model)


def split_drafter_beside(target_folder: str) -> Optional[str]:
    """``NAME-mtp`` beside the folder ``NAME`` when it holds a split MTP
    drafter (``convert --split-drafter``, ``add-drafter --split``)."""
    beside = str(Path(target_folder).with_name(Path(target_folder).name + "-mtp"))
    try:
        return beside if drafter_kind(beside) == "mtp" else None
    except (OSError, ValueError):
        return None


def auto_choice(target_folder: str, draft_folder: Optional[str] = None
                ) -> tuple[str, Optional[str], str]:
    """What ``auto`` stands for with these folders: ``(mode, draft folder,
    why)``, the draft folder the one given, or a split drafter found beside
    the target."""
    if draft_folder:
        kind = drafter_kind(draft_folder)
        return f"ngram,{kind}", draft_folder, (
            f"prompt lookup mixed per row with the {kind} drafter in --draft-model "
            f"{draft_folder}")
    if has_mtp_layer(target_folder):
        return "ngram,mtp", None, ("prompt lookup mixed per row with the checkpoint's own "
                                   "MTP layer")
    beside = split_drafter_beside(target_folder)
    if beside:
        return "ngram,mtp", beside, (f"prompt lookup mixed per row with the split MTP "
                                     f"drafter beside the model, {beside}")
    line = dropped_layer_line(target_folder)
    if line:
        logging.getLogger(__name__).warning(line)
    return "ngram", None, ("prompt lookup alone: the model comes with no drafter (an MTP "
                           "layer, or --draft-model for a head or a draft model)")


def auto_mode(target_folder: str, draft_folder: Optional[str] = None) -> str:
    """The mode ``auto`` stands for with these folders."""
    return auto_choice(target_folder, draft_folder)[0]
