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
(``--drafter unquantized``). It goes into OUT as ``mtp.safetensors``
(``mtp.`` + the head's own names, which mlx-lm's loader never reads), its
per-layer quantization in ``config.json`` under ``mtp.``; or, with
``--split-drafter``, into a folder of its own, OUT-mtp (``model_type``
``qwen3_5_mtp`` / ``glm4_moe_mtp`` / ...), which ``auto`` finds beside OUT.

A source without such a layer converts as mlx-lm would, and says so. The
folders are built under temporary names and renamed into place; what fails
on the way (mlx-lm refusing the checkpoint, a full disk) is one
``ConvertError`` line, with nothing left behind. The target is held in
memory once, tensor by tensor with a progress line. ``graft.py``
(add-drafter) writes a drafter with the same pieces.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from .source import resolve_model

DTYPES = ("float32", "float16", "bfloat16")
DRAFTER_PRECISIONS = ("quantized", "unquantized")
GROUP_SIZE = 64
MTP_FILE = "mtp.safetensors"


class ConvertError(ValueError):
    """A conversion refused, with one line that says why."""


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def failing_as(what: str) -> Iterator[None]:
    """Expected failures inside (mlx-lm refusing a checkpoint, a full disk)
    as one ``ConvertError`` line after ``what``, not a traceback."""
    try:
        yield
    except ConvertError:
        raise
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise ConvertError(f"{what}: {e.strerror or e}{where}") from None
    except (ValueError, KeyError, RuntimeError) as e:
        detail = " ".join(str(e).split())  # mlx-lm and MLX put names on lines of their own
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        raise ConvertError(f"{what}: {kind}{detail}") from None


@contextmanager
def building(targets: list[Path], replace: bool = False) -> Iterator[list[Path]]:
    """Temporary folders beside ``targets``, renamed into place when the
    block ends well, removed when it does not: no target is half written.
    ``replace``: a target that exists goes once the new one is in place."""
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    builds = [Path(tempfile.mkdtemp(prefix=f".{t.name}.", dir=t.parent)) for t in targets]
    placed, old = [], []  # old: folders holding a replaced target until the end
    try:
        yield builds
        for build, target in zip(builds, targets):
            if replace and target.exists():
                old.append(Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent)))
                target.rename(old[-1] / target.name)
            build.chmod(0o755)  # mkdtemp makes it private
            build.rename(target)
            placed.append(target)
    except BaseException:
        for target in placed:
            shutil.rmtree(target, ignore_errors=True)
        for aside in old:
            for moved in aside.iterdir():
                moved.rename(aside.parent / moved.name)
        raise
    finally:
        for folder in builds + old:
            shutil.rmtree(folder, ignore_errors=True)


def split_folder(out) -> Path:
    """Where ``--split-drafter`` writes the drafter: OUT-mtp beside OUT."""
    out = Path(out)
    return out.with_name(out.name + "-mtp")


def read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except OSError:
        raise ConvertError(f"{folder} has no config.json: not a model folder") from None
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


def quantized_as(config: dict) -> Optional[dict]:
    """An MLX folder's quantization settings (bits, group size, mode), None
    where it is not quantized."""
    q = config.get("quantization")
    return {"bits": q["bits"], "group_size": q["group_size"], "mode": q.get("mode", "affine")} \
        if isinstance(q, dict) and "bits" in q else None


def shard_header(path: Path) -> dict:
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
        names.update(k for k in shard_header(path) if k != "__metadata__")
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


def read_head(target, folder: Path, what: str):
    """The MTP head of ``target`` from the checkpoint ``folder`` as the server
    loads it (``spec_decode/heads/mtp.py``), or what is missing or misfits."""
    from ..spec_decode.heads.mtp import load_mtp_head

    with failing_as(f"{what}: reading the MTP layer"):
        try:
            return load_mtp_head(target, str(folder), what=what)
        except ValueError as e:  # its own line, naming the tensors
            raise ConvertError(str(e)) from None


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


def _without_drafter_entries(config: dict) -> dict:
    """``config`` without an earlier drafter's layers (``mtp.*``) in its
    quantization: the drafter's are recorded anew from its tensors."""
    return {key: {k: v for k, v in value.items() if not k.startswith("mtp.")}
            if key.startswith("quantization") and isinstance(value, dict) else value
            for key, value in config.items()}


def quantized_layers(module) -> dict:
    """{layer path: its quantization settings} for every quantized layer of
    ``module``: what its tensors are, whatever settings were asked for."""
    return {path: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
            for path, m in module.named_modules() if "scales" in m and hasattr(m, "bits")}


def drafter_weights(head, settings: Optional[dict], predicate) -> tuple[dict, dict]:
    """The MTP head's tensors (its own names), quantized with ``settings``
    (bits, group size, mode; None: left as they are) and the family's
    predicate, and the quantization its layers have (``quantized_layers``)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    if settings:
        head, _ = quantize_model(head, {}, settings["group_size"], settings["bits"],
                                 mode=settings["mode"], quant_predicate=predicate)
    return dict(tree_flatten(head.parameters())), quantized_layers(head)


def precision(layers: dict) -> str:
    """``quantized_layers`` in words: ``4-bit``, ``unquantized``."""
    return "/".join(sorted({f"{s['bits']}" for s in layers.values()})) + "-bit" if layers \
        else "unquantized"


def write_drafter_inside(out: Path, weights: dict, layers: dict) -> None:
    """``OUT/mtp.safetensors`` (``mtp.`` + the head's names), and OUT's
    config recording under ``mtp.`` the head's layers quantized otherwise
    than the target. Both are written beside and renamed into place: a
    graft onto a folder that serves is never half done."""
    import mlx.core as mx

    config = _without_drafter_entries(json.loads((out / "config.json").read_text()))
    target = quantized_as(config)
    assert target or not layers, "an unquantized target's config records no quantized layer"
    per_layer = {"mtp." + p: s for p, s in layers.items() if s != target}
    if per_layer:
        config["quantization"].update(per_layer)
        config["quantization_config"] = config["quantization"]
    scratch = Path(tempfile.mkdtemp(prefix=".mtp.", dir=out))  # not *.safetensors in OUT
    try:
        mx.save_safetensors(str(scratch / MTP_FILE), {"mtp." + k: v for k, v in weights.items()},
                            metadata={"format": "mlx"})
        (scratch / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))
        (scratch / MTP_FILE).replace(out / MTP_FILE)
        (scratch / "config.json").replace(out / "config.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_drafter_split(folder: Path, weights: dict, layers: dict, target_config: dict,
                        dtype: Optional[str], source: str) -> None:
    """A split drafter folder: the head's tensors, and a config that says what
    it is (a nextn layer: which decoder layer) and how its tensors are quantized."""
    import mlx.core as mx

    from ..spec_decode.heads.mtp import mtp_layer_count, nextn_prefix, split_model_type

    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    text = target_config.get("text_config", target_config)
    config = {"model_type": split_model_type(target_config), "converted_from": source,
              "mtp_num_hidden_layers": mtp_layer_count(target_config)}
    if nextn_prefix(target_config) is not None:
        config.update(num_nextn_predict_layers=1, num_hidden_layers=text["num_hidden_layers"])
    if dtype:
        config["torch_dtype"] = dtype
    if layers:
        # The commonest settings for all, the layers that differ under their own path.
        common = dict(Counter(tuple(s.items()) for s in layers.values()).most_common(1)[0][0])
        quantization = {**common, **{p: s for p, s in layers.items() if s != common}}
        config["quantization"] = config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=4))


def convert(source: str, out: str, bits: Optional[int] = None, dtype: Optional[str] = None,
            drafter: str = "quantized", split: bool = False,
            progress: Optional[Callable] = None,
            say: Callable[[str], None] = stderr_line) -> list[Path]:
    """Convert ``source`` (a Hugging Face folder or hub id) into ``out``
    (and OUT-mtp with ``split``): the folders written. Raises
    ``ConvertError`` with one line for the user."""
    from mlx_lm.utils import quantize_model

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
    try:  # a local folder, or a hub id's snapshot (downloaded where the hub is reachable)
        folder, _ = resolve_model(source)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    config = read_config(folder)
    check_family(config, folder)
    already = quantized_as(config)
    if bits and already:
        raise ConvertError(f"{source} is already quantized ({already['bits']}-bit): --quantize "
                           "cannot quantize it again; convert it without --quantize (it keeps "
                           "its precision), or convert the Hugging Face original")
    declared, held = drafter_layers_held(config, tensor_names(folder))
    say(f"converting {source} ({config['model_type']}, {dtype or 'its own dtype'}"
        f"{f', {bits}-bit' if bits else ''}) into {out}")

    with failing_as(f"mlx-lm cannot load {source}"):
        model, tokenizer, config, dtype = load_target(folder, dtype)
    config = _without_drafter_entries(config)
    head = None
    if declared and held:
        head = read_head(model, folder, what=f"convert {source}")
        if drafter == "unquantized" and quantized_layers(head):
            raise ConvertError(f"{source}'s MTP layer is already quantized: --drafter "
                               "unquantized needs the Hugging Face original")
    elif declared:
        say(f"{source} declares {declared} MTP layer(s) but holds none of their weights (an "
            "earlier conversion dropped them): converted as mlx-lm converts it, without")
    else:
        say(f"{source} has no MTP layer: converted as mlx-lm converts it "
            "(--spec-decode auto will draft with prompt lookup)")
    predicate = getattr(model, "quant_predicate", None)
    settings = {"bits": bits, "group_size": GROUP_SIZE, "mode": "affine"} if bits else None
    if settings:  # as mlx_lm.convert --quantize does
        with failing_as(f"quantizing {source}"):
            model, config = quantize_model(model, config, GROUP_SIZE, bits)

    targets = [out, split_folder(out)] if split and head is not None else [out]
    with failing_as(f"writing {out}"), building(targets) as builds:
        write_target(model, tokenizer, config, folder, builds[0], progress)
        if head is not None:
            weights, layers = drafter_weights(
                head, settings if drafter == "quantized" else None, predicate)
            if split:
                write_drafter_split(builds[1], weights, layers, config, dtype, source)
            else:
                write_drafter_inside(builds[0], weights, layers)
            where = f"{targets[1]} (--draft-model)" if split else f"{out}/{MTP_FILE}"
            say(f"MTP layer kept in {where}, {precision(layers)}")
    return targets
