"""``mlx-lm-server-models add-drafter``: a checkpoint's MTP / nextn layer
grafted from its Hugging Face original onto an MLX folder whose conversion
dropped it.

People serve mlx-community folders (4-bit, mostly), and mlx-lm's
conversions drop ``mtp.*`` and the nextn layer; ``convert`` keeps them but
needs the original whole (a 27B model is about 54 GB in bf16). The layer
lives in one or two of the original's shards, and its
``model.safetensors.index.json`` says which: only those are read, from a
local folder or downloaded from the hub file by file (huggingface_hub's
``hf_hub_download``, with its progress bar). The layer is built against the
target as ``convert`` builds it and written with the same pieces
(``convert.py``): loaded as the server loads it (renamed, the family's
``sanitize``, norms shifted, experts stacked), cast to the target's compute
dtype, quantized as the target is (its bits, group size and mode, the
family's per-layer predicate), then written

- into TARGET as ``mtp.safetensors`` (renamed into place, the config
  recording its layers' quantization), so that TARGET is what ``convert``
  would have written; or
- with ``--split``, as the split folder TARGET-mtp, where ``--spec-decode
  auto`` finds it.

Refused in one line, with nothing written: an original that is not the
target's (architecture, hidden size, vocabulary, layer count, MTP layers),
a target that already holds the layer (unless ``--replace``), a shard the
layer needs that is missing or truncated.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable, Optional

from .convert import (MTP_FILE, ConvertError, building, check_family, drafter_layers_held,
                      drafter_weights, failing_as, precision, quantized_as, read_config,
                      read_head, shard_header, split_folder, stderr_line, tensor_names,
                      write_drafter_inside, write_drafter_split)

INDEX = "model.safetensors.index.json"
# What the original must share with the target (its text config's).
MATCHED = ("hidden_size", "vocab_size", "num_hidden_layers")


def original_files(original: str, say: Callable[[str], None]) -> Callable[[str], Optional[Path]]:
    """name -> the original's file of that name (None: it has none): from a
    local folder, or downloaded from the hub (or its cache), one file at a
    time."""
    from .source import is_repo_id

    folder = Path(original).expanduser()
    if folder.is_dir():
        return lambda name: folder / name if (folder / name).is_file() else None
    if not is_repo_id(original):
        raise ConvertError(f"--from {original!r} is neither a folder nor a Hugging Face hub id "
                           "(ORG/NAME)")
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    except ImportError:
        raise ConvertError(f"--from {original}: huggingface_hub is not installed, so nothing can "
                           "be downloaded; give a local folder of the original") from None

    def fetch(name: str) -> Optional[Path]:
        say(f"fetching {original}/{name}")
        try:
            return Path(hf_hub_download(original, name))
        except LocalEntryNotFoundError as e:  # neither cached nor reachable
            raise ConvertError(f"--from {original}: {name} is not in the hub cache and could "
                               f"not be downloaded ({' '.join(str(e).split())})") from None
        except EntryNotFoundError:
            return None
        except Exception as e:  # the hub's errors: a network, a repo or a token refused
            raise ConvertError(f"--from {original}: {name} could not be downloaded "
                               f"({type(e).__name__}: {' '.join(str(e).split())})") from None
    return fetch


def mismatches(target_config: dict, original_config: dict) -> list[str]:
    """What tells the original apart from the target's (empty: it is the
    target's): the family, the text config's sizes, the MTP layers."""
    from ..spec_decode.heads.mtp import mtp_layer_count

    found = []
    if original_config.get("model_type") != target_config.get("model_type"):
        found.append(f"model_type {original_config.get('model_type')!r} against "
                     f"{target_config.get('model_type')!r}")
    text = target_config.get("text_config", target_config)
    other = original_config.get("text_config", original_config)
    found += [f"{key} {other.get(key)} against {text.get(key)}" for key in MATCHED
              if other.get(key) != text.get(key)]
    declared = mtp_layer_count(target_config), mtp_layer_count(original_config)
    if not found and declared[0] != declared[1]:
        found.append(f"{declared[1]} MTP layer(s) declared against {declared[0]}")
    return found


def drafter_shards(config: dict, weight_map: Optional[dict]) -> list[str]:
    """The shards that hold the layer (``mtp.*``, or the nextn layer), as the
    index names them; without an index, the one ``model.safetensors``."""
    from ..spec_decode.heads.mtp import nextn_prefix

    if weight_map is None:
        return ["model.safetensors"]
    prefixes = ("mtp.",) + ((nextn_prefix(config),) if nextn_prefix(config) else ())
    return sorted({shard for name, shard in weight_map.items() if name.startswith(prefixes)})


def _refuse_held(target: Path, config: dict, split: bool, replace: bool) -> None:
    """A target that holds the layer already is refused, unless ``--replace``
    replaces what was grafted (``mtp.safetensors``, or TARGET-mtp)."""
    _, held = drafter_layers_held(config, tensor_names(target))
    inside = (target / MTP_FILE).exists()
    if held and not inside:
        raise ConvertError(f"{target} holds its MTP layer in its own weights: nothing to graft")
    if held and split:
        raise ConvertError(f"{target} holds its MTP layer ({target / MTP_FILE}), which a split "
                           "drafter beside it would not replace: remove that file first, or "
                           "graft without --split")
    if held and not replace:
        raise ConvertError(f"{target} already holds its MTP layer ({target / MTP_FILE}): "
                           "--replace replaces it")
    if split and split_folder(target).exists() and not replace:
        raise ConvertError(f"{split_folder(target)} exists: --replace replaces it")


def add_drafter(target: str, original: str, split: bool = False, replace: bool = False,
                say: Callable[[str], None] = stderr_line) -> Path:
    """Graft ``original``'s MTP layer onto the MLX folder ``target``: the
    folder written (TARGET, or TARGET-mtp with ``split``). Raises
    ``ConvertError`` with one line for the user; every refusal comes before
    anything is written."""
    from mlx_lm.utils import load_model

    from ..spec_decode.heads import compute_dtype
    from ..spec_decode.heads.mtp import mtp_layer_count

    target = Path(target)
    config = read_config(target)
    check_family(config, target)
    _refuse_held(target, config, split, replace)
    files = original_files(original, say)
    found = files("config.json")
    if found is None:
        raise ConvertError(f"{original} has no config.json: not a Hugging Face model folder")
    original_config = read_config(found.parent)
    problems = mismatches(config, original_config)
    if problems:
        raise ConvertError(f"{original} is not the original of {target}: "
                           f"{'; '.join(problems)} (the original's against the target's)")
    if not mtp_layer_count(original_config):
        raise ConvertError(f"{original} declares no MTP layer: nothing to graft")
    index = files(INDEX)
    with failing_as(f"{original}: {INDEX} is not a readable index"):
        weight_map = json.loads(index.read_text())["weight_map"] if index else None
    shards = drafter_shards(original_config, weight_map)
    if not shards:
        raise ConvertError(f"{original}: {INDEX} names no tensor of its MTP layer")
    paths = [files(shard) for shard in shards]
    missing = [shard for shard, path in zip(shards, paths) if path is None]
    if missing:
        raise ConvertError(f"{original}: {', '.join(missing)} (which holds its MTP layer) "
                           "missing")
    for path in paths:
        shard_header(path)
    say(f"grafting the MTP layer of {original} ({', '.join(shards)}) onto {target}")

    with failing_as(f"mlx-lm cannot load {target}"):
        model, _ = load_model(target, lazy=True)
    with tempfile.TemporaryDirectory() as staged:  # the original, but the shards it needs
        (Path(staged) / "config.json").write_text(json.dumps(original_config))
        for path in paths:
            (Path(staged) / path.name).symlink_to(path.resolve())
        try:
            head = read_head(model, Path(staged), what=f"add-drafter --from {original}")
        except ConvertError as e:
            raise ConvertError(str(e).replace(staged, original)) from None
        with failing_as(f"quantizing the MTP layer of {original}"):
            weights, layers = drafter_weights(head, quantized_as(config),
                                              getattr(model, "quant_predicate", None))
        where = split_folder(target) if split else target
        with failing_as(f"writing {where}"):
            if split:
                dtype = str(compute_dtype(model)).rsplit(".", 1)[-1]
                with building([where], replace=replace) as (build,):
                    write_drafter_split(build, weights, layers, config, dtype, original)
            else:
                write_drafter_inside(target, weights, layers)
    say(f"MTP layer grafted into {where if split else where / MTP_FILE}, {precision(layers)}")
    return where
