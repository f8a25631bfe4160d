"""A Hugging Face checkpoint -> an MLX folder that keeps its drafter layer.

mlx-lm's conversions drop a checkpoint's multi-token-prediction layer
(Qwen3.5 / Qwen3-Next's ``mtp.*``, DeepSeek-V3 / GLM-4.5's nextn layer
``model.layers.{num_hidden_layers}``: their families' ``sanitize``), so
every mlx-community folder of those models serves without its drafter.
Here the target is converted as ``mlx_lm.convert`` converts it, with the
same public functions (``load``, the cast to ``--dtype`` but what the
family keeps, ``quantize_model`` with the family's predicate,
``save_model``, ``save_config``, the tokenizer), and the drafter layer is
converted beside it as the server loads it (``spec_decode/heads/mtp.py``:
renamed, the family's ``sanitize``, norms shifted, experts stacked), cast
to the same dtype and quantized like the target, or left unquantized
(``--drafter unquantized``). It goes:

- into OUT, as ``mtp.safetensors`` (keys ``mtp.`` + the head's own names,
  which mlx-lm's loader never reads: it reads ``model*.safetensors``), its
  per-layer quantization in ``config.json`` under ``mtp.``; or
- with ``--split-drafter``, into a folder of its own, OUT-mtp
  (``model_type`` ``qwen3_5_mtp`` / ``glm4_moe_mtp`` / ...), which
  ``--draft-model`` and ``--spec-decode auto`` take.

A source without such a layer converts as mlx-lm would, and says so. The
folders are written under temporary names and renamed into place, so none
is ever half written. The converted target is held in memory once (as
serving it would be), tensor by tensor with a progress line.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

DTYPES = ("float32", "float16", "bfloat16")
DRAFTER_PRECISIONS = ("quantized", "unquantized")
GROUP_SIZE = 64
MTP_FILE = "mtp.safetensors"


class ConvertError(ValueError):
    """A conversion refused, with one line that says why."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def split_folder(out) -> Path:
    """Where ``--split-drafter`` writes the drafter: OUT-mtp beside OUT."""
    out = Path(out)
    return out.with_name(out.name + "-mtp")


def source_folder(source: str) -> Path:
    """A local folder, or a hub id's snapshot (downloaded where the hub is reachable)."""
    from .source import resolve_model

    try:
        folder, _ = resolve_model(source)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    return folder


def read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except OSError:
        raise ConvertError(f"{folder} has no config.json: not a Hugging Face model folder") \
            from None
    except ValueError as e:
        raise ConvertError(f"{folder}/config.json is not JSON ({e})") from None
    if "model_type" not in config:
        raise ConvertError(f"{folder}/config.json names no model_type")
    return config


def check_family(config: dict, folder: Path) -> None:
    from ..runtime import mlx_lm_adapter

    if mlx_lm_adapter.model_module(config) is None:
        raise ConvertError(f"{folder}: model_type {config['model_type']!r} is not a family "
                           "this mlx-lm knows (mlx_lm.models has no module for it)")


def _header(path: Path) -> dict:
    """A safetensors file's header, checked against the file's size: a
    corrupt or truncated shard is refused before anything is converted."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header claims {length} bytes of {size}")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{path} is not a readable safetensors file ({e})") from None
    if 8 + length + end > size:
        raise ConvertError(f"{path} is truncated: its tensors end at byte {8 + length + end}, "
                           f"the file at {size}")
    return header


def tensor_names(folder: Path) -> set[str]:
    """Every tensor name of the folder's weight files, each file checked,
    and every shard its index names present."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as e:
            raise ConvertError(f"{index} is not a readable index ({e})") from None
        missing = sorted(n for n in named if not (folder / n).exists())
        if missing:
            raise ConvertError(f"{folder}: {', '.join(missing)} (named in "
                               "model.safetensors.index.json) missing")
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise ConvertError(f"{folder} has no model*.safetensors weights")
    names = set()
    for path in files + [p for p in [folder / MTP_FILE] if p.exists()]:  # a conversion's own
        names.update(k for k in _header(path) if k != "__metadata__")
    return names


def drafter_layers_held(config: dict, names: set[str]) -> tuple[int, bool]:
    """(MTP layers the config declares, whether the weights hold any of them)."""
    from ..spec_decode.heads.mtp import mtp_layer_count, nextn_prefix

    nextn = nextn_prefix(config)
    held = any(n.startswith("mtp.") or (nextn is not None and n.startswith(nextn))
               for n in names)
    return mtp_layer_count(config), held


def load_target(folder: Path, dtype: Optional[str]):
    """(model, tokenizer, config, dtype): loaded lazily as ``mlx_lm.convert``
    loads it, cast to ``dtype`` (default: the checkpoint's own) but the
    parameters the family keeps as they are."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm import load

    from ..runtime import mlx_lm_adapter

    model, tokenizer, config = load(str(folder), return_config=True, lazy=True)
    dtype = dtype or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    if dtype in DTYPES:
        keep = mlx_lm_adapter.keeps_dtype(model)

        def cast(path, value):
            if mx.issubdtype(value.dtype, mx.floating) and not keep(path):
                return value.astype(getattr(mx, dtype))
            return value

        model.update(tree_map_with_path(cast, model.parameters()))
    return model, tokenizer, config, dtype


def quantize(module, config: dict, bits: int, predicate=None):
    """``module`` quantized as ``mlx_lm.convert --quantize`` does (affine,
    group size 64, the family's predicate): (module, config with
    ``quantization``)."""
    from mlx_lm.utils import quantize_model

    return quantize_model(module, config, GROUP_SIZE, bits, quant_predicate=predicate)


def evaluate_with_progress(module, progress: Optional[Callable]) -> None:
    """Every parameter computed now (read, cast, quantized), one at a time."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(module.parameters())
    for i, (name, value) in enumerate(params, 1):
        mx.eval(value)
        if progress:
            progress(i, len(params), name)


def write_target(model, tokenizer, config: dict, source: Path, out: Path,
                 progress: Optional[Callable]) -> None:
    from mlx_lm.utils import save_config, save_model

    evaluate_with_progress(model, progress)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    tokenizer.save_pretrained(str(out))
    for pattern in ("*.py", "generation_config.json"):
        for path in source.glob(pattern):
            shutil.copy(path, out)


def drafter_weights(head, bits: Optional[int], predicate) -> tuple[dict, Optional[dict]]:
    """The MTP head's tensors (its own names) and its quantization settings
    (None: left unquantized)."""
    from mlx.utils import tree_flatten

    quantization = None
    if bits:
        head, qconfig = quantize(head, {}, bits, predicate)
        quantization = qconfig["quantization"]
    return dict(tree_flatten(head.parameters())), quantization


def write_drafter_inside(out: Path, weights: dict, quantization: Optional[dict]) -> None:
    """``OUT/mtp.safetensors`` (``mtp.`` + the head's names); per-layer
    quantization recorded in OUT's config under ``mtp.``."""
    import mlx.core as mx

    mx.save_safetensors(str(out / MTP_FILE), {"mtp." + k: v for k, v in weights.items()},
                        metadata={"format": "mlx"})
    per_layer = {"mtp." + k: v for k, v in (quantization or {}).items() if isinstance(v, dict)}
    if per_layer:
        config = json.loads((out / "config.json").read_text())
        config["quantization"].update(per_layer)
        config["quantization_config"] = config["quantization"]
        (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))


def write_drafter_split(folder: Path, weights: dict, quantization: Optional[dict],
                        target_config: dict, dtype: Optional[str], source: str) -> None:
    """A split drafter folder: the head's tensors and a config that says
    what it is (and, for a nextn layer, which decoder layer it is)."""
    import mlx.core as mx

    from ..spec_decode.heads.mtp import mtp_layer_count, nextn_prefix, split_model_type

    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    text = target_config.get("text_config", target_config)
    config = {"model_type": split_model_type(target_config), "converted_from": source,
              "mtp_num_hidden_layers": mtp_layer_count(target_config)}
    if nextn_prefix(target_config) is not None:
        config.update(num_nextn_predict_layers=1, num_hidden_layers=text["num_hidden_layers"])
    if dtype:
        config["torch_dtype"] = dtype
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=4))


def convert(source: str, out: str, bits: Optional[int] = None, dtype: Optional[str] = None,
            drafter: str = "quantized", split: bool = False,
            progress: Optional[Callable] = None, say: Callable[[str], None] = _say) -> list[Path]:
    """Convert ``source`` (a Hugging Face folder or hub id) into ``out``
    (and OUT-mtp with ``split``): the folders written. Raises
    ``ConvertError`` with one line for the user."""
    from ..spec_decode.heads.mtp import load_mtp_head

    if bits not in (None, 4, 8):
        raise ConvertError(f"--quantize must be 4 or 8, not {bits!r}")
    if dtype not in (None, *DTYPES):
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if drafter not in DRAFTER_PRECISIONS:
        raise ConvertError(f"--drafter must be one of {', '.join(DRAFTER_PRECISIONS)}")
    out = Path(out)
    for target in [out, split_folder(out)] if split else [out]:
        if target.exists():
            raise ConvertError(f"{target} exists: give a new folder (nothing is overwritten)")
    folder = source_folder(source)
    config = read_config(folder)
    check_family(config, folder)
    declared, held = drafter_layers_held(config, tensor_names(folder))
    say(f"converting {source} ({config['model_type']}, {dtype or 'its own dtype'}"
        f"{f', {bits}-bit' if bits else ''}) into {out}")

    model, tokenizer, config, dtype = load_target(folder, dtype)
    head = None
    if declared and held:
        try:
            head = load_mtp_head(model, str(folder), what=f"convert {source}")
        except ValueError as e:
            raise ConvertError(str(e)) from None
    elif declared:
        say(f"{source} declares {declared} MTP layer(s) but holds none of their weights (an "
            "earlier conversion dropped them): converted as mlx-lm converts it, without")
    else:
        say(f"{source} has no MTP layer: converted as mlx-lm converts it "
            "(--spec-decode auto will draft with prompt lookup)")
    predicate = getattr(model, "quant_predicate", None)
    if bits:
        model, config = quantize(model, config, bits)

    targets = [out, split_folder(out)] if split and head is not None else [out]
    out.parent.mkdir(parents=True, exist_ok=True)
    builds = [Path(tempfile.mkdtemp(prefix=f".{t.name}.", dir=t.parent)) for t in targets]
    try:
        write_target(model, tokenizer, config, folder, builds[0], progress)
        if head is not None:
            head_bits = bits if drafter == "quantized" else None
            weights, quantization = drafter_weights(head, head_bits, predicate)
            if split:
                write_drafter_split(builds[1], weights, quantization, config, dtype, source)
            else:
                write_drafter_inside(builds[0], weights, quantization)
            where = f"{targets[1]} (--draft-model)" if split else f"{out}/{MTP_FILE}"
            say(f"MTP layer kept in {where}, "
                f"{f'{head_bits}-bit' if head_bits else 'unquantized'}")
        for build, target in zip(builds, targets):
            build.chmod(0o755)  # mkdtemp makes it private
            build.rename(target)
    finally:
        for build in builds:
            if build.exists():
                shutil.rmtree(build, ignore_errors=True)
    return targets
