"""The prompt cache's disk tier (``--prompt-cache-dir``, ``--prompt-cache-disk-bytes``).

Agents and editors send the same long prefix (system prompt, tools) in every
session; the memory tier forgets it at every restart and holds only what
memory allows. Each finished request's caches are also written here, and a
request whose prefix is on disk but not in memory reads them back instead of
prefilling.

An entry is one file, ``pc-<space>-<tokens>-<sum>.safetensors``, in upstream's
``save_prompt_cache`` format (the layers' states) with our metadata: the
format, the space, the token ids, whether the layers can be cut back.

- ``<space>`` names everything that makes an entry valid (``space_key``): the
  weights (every byte of their files, read again only when a file changes),
  the adapter, ``--kv-bits``, the layer cache kinds, mlx and mlx-lm's
  versions and this format. A different model or configuration never reads
  another's entries; several models share the folder and its bound. The
  tokenizer and chat template are not in it: an entry is keyed by token
  ids, and the layers a model computes from ids do not depend on how text
  became them.
- ``<sum>`` is the CRC-32 of the whole file, checked on every read: a flipped
  byte, a truncated or foreign file is damage, logged once and deleted, and
  the request prefills as if nothing were stored.
- Found by the memory tier's rule (``tokens_served``): an entry that is a prefix of
  the prompt as it is (recurrent states only at the positions they were
  stored), a longer or diverging one cut back when its layers can be.
- Written on a thread of its own from arrays the inference thread evaluated:
  to a temporary name of this process (locked while written), then renamed,
  so a reader, another server or a crash never sees half a file. A write
  that cannot be made (a full disk, a folder made read-only) turns the tier
  off with one warning; the memory tier goes on.
- Read in two halves: a background check of the file (every byte read and
  summed on a thread of its own, while the batch decodes: admission asks
  ``ready`` first, with or without a KV budget), then the arrays loaded on
  the inference thread from the page cache the check filled. ``load``
  never sums a file itself: an entry not checked yet is a miss.
- Deleted only when proven damaged (its checksum, its header or metadata);
  an error that proves nothing (out of memory, a permission) keeps the
  file, logged, and the request prefills.
- Bounded: before and after each write the oldest files (by time of last
  use) go until the folder's entries, of every space, fit the bound; a
  partial write a stopped process left is removed once it is a minute old
  and no writer holds its lock.

One module because the file's name, format, checksum, space key and the
folder's bound are one contract: whether a file may be trusted is decided by
reading them together, and a change to any one is a new format.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (KVCache, can_trim_prompt_cache, load_prompt_cache,
                                 make_prompt_cache, save_prompt_cache, trim_prompt_cache)

from .traffic import being_written

log = logging.getLogger("mlx_lm_server.serving.prompt_cache_disk")

FORMAT = 1
ENTRY_GLOB = "pc-*.safetensors"
TEMP_PREFIX = ".pc-tmp-"
STALE_TEMP_S = 60.0  # an unlocked partial write this old was left by a stopped process
_UPSTREAM = KVCache.__module__  # where upstream's cache classes live
_CHUNK = 8 << 20  # bytes read at a time for the checksum
WEIGHT_DIGESTS = ".weights-digests.json"  # in the folder: each weight file's digest
_DIGESTS: dict[tuple, str] = {}  # a weight file's _identity -> its digest, this process


# ---- what makes an entry valid ---------------------------------------------

def file_digest(path: Path) -> str:
    """blake2b over every byte of ``path``."""
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _identity(path: Path) -> tuple:
    """What changes when a file's bytes may have: where it is, its inode, size
    and times (the change time too: a copy that keeps the mtime still sets it)."""
    st = path.stat()
    return (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remembered(file: Optional[Path]) -> dict:
    """The digests a file remembers, {path: [inode, size, mtime, ctime, digest]};
    empty when it is missing or damaged."""
    try:
        known = json.loads(file.read_text()) if file is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember(file: Path, digests: dict) -> None:
    """Add ``digests`` to ``file`` (written whole, then renamed); a failure
    costs only a read of the weights at the next start."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.json")
        tmp.write_text(json.dumps({**_remembered(file), **digests}))
        os.replace(tmp, file)
    except OSError as e:
        log.debug("prompt cache on disk: could not remember the weights' digests: %s", e)


def weight_digests(paths: Sequence[Path], remembered: Optional[Path] = None) -> list[str]:
    """Each file's ``file_digest``, read again only when the file changes
    (``_identity``): remembered by this process and in ``remembered``, a
    JSON file, across restarts. Run at start-up, files in parallel."""
    known, found, todo = _remembered(remembered), {}, []
    idents = [_identity(path) for path in paths]
    for path, ident in zip(paths, idents):
        if ident in _DIGESTS:
            continue
        record = known.get(ident[0])
        if isinstance(record, list) and record[:-1] == list(ident[1:]) \
                and isinstance(record[-1], str):
            _DIGESTS[ident] = record[-1]
        else:
            todo.append((path, ident))
    if todo:
        tic = time.perf_counter()
        with ThreadPoolExecutor(min(8, len(todo))) as pool:
            digests = list(pool.map(file_digest, [path for path, _ in todo]))
            for (_, ident), digest in zip(todo, digests):
                _DIGESTS[ident] = digest
                found[ident[0]] = [*ident[1:], digest]
        took = time.perf_counter() - tic
        if took > 1:
            log.info("prompt cache on disk: hashed the weights (%.1f GB) in %.1f s",
                     sum(ident[2] for _, ident in todo) / 1e9, took)
        if remembered is not None:
            _remember(remembered, found)
    return [_DIGESTS[ident] for ident in idents]


def weights_fingerprint(folder: Path, remembered: Optional[Path] = None) -> str:
    """A digest of a model folder: every byte of each weight file
    (``weight_digests``), and the config and Python files. Samples would
    not do: a LoRA fused into its base keeps names, sizes and headers and
    changes a few percent of the bytes."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for path in files:
        if path.suffix in (".json", ".py") and not path.name.startswith(("tokenizer", ".")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    weights = [p for p in files if p.suffix in (".safetensors", ".gguf", ".npz")]
    for path, digest in zip(weights, weight_digests(weights, remembered)):
        h.update(f"{path.name}\0{digest}\0".encode())
    return h.hexdigest()


def adapter_fingerprint(folder: Optional[str]) -> str:
    """A digest of an adapter folder's files, read whole (adapters are small)."""
    if not folder:
        return "none"
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def layer_kinds(model) -> list[str]:
    """Each layer's cache kind as the model makes it, with what fixes its
    layout (a window's size, quantization bits)."""
    kinds = []
    for c in make_prompt_cache(model):
        extra = [f"{a}={getattr(c, a)}" for a in ("max_size", "keep", "bits", "group_size")
                 if isinstance(getattr(c, a, None), int)]
        kinds.append(":".join([type(c).__name__, *extra]))
    return kinds


def space_key(weights: str, adapter: str, kv_bits: Optional[int], kv_group_size: int,
              kinds: Sequence[str]) -> str:
    """The 16 hex digits naming one model and configuration's entries."""
    from importlib.metadata import version

    parts = [f"format={FORMAT}", f"mlx={mx.__version__}", f"mlx_lm={version('mlx_lm')}",
             f"weights={weights}", f"adapter={adapter}", f"kv_bits={kv_bits}",
             f"kv_group_size={kv_group_size if kv_bits else None}", *kinds]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


# ---- which entry serves a prompt -------------------------------------------

def tokens_served(ids: np.ndarray, trimmable: bool, tokens: np.ndarray) -> int:
    """Prompt tokens an entry holding ``ids`` gives a request for ``tokens``,
    by the memory tier's rule: a prefix of the prompt as it is; anything else
    cut back to the common prefix, if its layers can be, and always short of
    the last prompt token (a sequence needs one fed token to predict from)."""
    n = min(len(ids), len(tokens))
    diff = np.flatnonzero(ids[:n] != tokens[:n])
    common = int(diff[0]) if diff.size else n
    if common == len(ids) < len(tokens):
        return common
    return min(common, len(tokens) - 1) if trimmable else 0


@dataclass(eq=False)
class Entry:
    """One stored sequence: on disk (``path``), or waiting to be written
    (``cache``: the arrays, shared with the memory tier)."""

    ids: np.ndarray  # [num_tokens] the token ids its layers hold
    trimmable: bool
    nbytes: int  # the file's size (an estimate while it waits)
    path: Optional[Path] = None
    cache: Optional[list] = None
    memory: Optional[weakref.ref] = None  # its first layer in the memory tier (stored here)
    check: Optional[Future] = None  # a background read of the file: None (good) or what is wrong
    queued: int = 0  # bytes counted in the tier's pending bytes until written

    @property
    def key(self) -> bytes:
        return self.ids.tobytes()

    @property
    def in_memory(self) -> bool:
        """The memory tier still holds its layers (it drops them when it evicts)."""
        return self.memory is not None and self.memory() is not None


def extends(e: Entry, other: Entry) -> bool:
    """Whether ``e`` supersedes ``other``: it holds other's tokens and more,
    in layers that can be cut back to them."""
    n = len(other.ids)
    return e.trimmable and len(e.ids) > n and np.array_equal(e.ids[:n], other.ids)


def nearest(entries: Sequence[Entry], tokens: np.ndarray) -> tuple[Optional[Entry], int]:
    """The entry that serves most of ``tokens`` (the smaller file on a tie), and how many."""
    best, most = None, 0
    for e in entries:
        n = tokens_served(e.ids, e.trimmable, tokens)
        if n > most or (n == most and n and e.nbytes < best.nbytes):
            best, most = e, n
    return best, most


# ---- files ------------------------------------------------------------------

def _token_digest(ids: np.ndarray) -> str:
    return hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=8).hexdigest()


def _ids(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def file_crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's metadata and the size its header says it has
    (8 bytes, the JSON header, then the data its tensors' offsets reach)."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 64 << 20:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    # save_prompt_cache keeps the metadata it is given under "0.".
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}, 8 + n + end


def _upstream_class(cls: type) -> type:
    """The mlx-lm cache class a layer's class is (ours subclass them)."""
    for c in cls.__mro__:
        if c.__module__ == _UPSTREAM:
            return c
    raise ValueError(f"{cls.__name__} is no kind of mlx-lm cache")


def _arrays(cache: list) -> list:
    return [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def portable(cache: list) -> list:
    """The layers as mlx-lm's own classes (what ``load_prompt_cache`` can
    make again) over contiguous copies of their arrays (shared buffers where
    they already are), evaluated: the writer thread then only reads memory."""
    out = [_upstream_class(type(c)).from_state(
        tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, c.state))
        for c in cache]
    mx.eval(_arrays(out))
    return out


def native(cache: list, types: Sequence[type]) -> list:
    """Loaded layers as the model's own classes (``types``, from its ``make_cache``)."""
    if len(cache) != len(types):
        raise ValueError(f"{len(cache)} layers, the model has {len(types)}")
    out = []
    for c, t in zip(cache, types):
        if type(c) is not _upstream_class(t):
            raise ValueError(f"a {type(c).__name__} layer where the model has {t.__name__}")
        out.append(c if type(c) is t else t.from_state(c.state))
    return out


def _entry_name(space: str, ids: np.ndarray, crc: int) -> str:
    return f"pc-{space}-{_token_digest(ids)}-{crc:08x}.safetensors"


class Damaged(ValueError):
    """A file proven not to be the entry its name says (deleted)."""


def _cannot_write(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


class DiskTier:
    """One model's entries in ``folder`` (its ``space``), the folder's files
    (every space's) kept within ``max_bytes``."""

    def __init__(self, folder: str, max_bytes: int, space: str, types: Sequence[type],
                 max_pending_bytes: int = 4 << 30):
        self.folder = Path(folder).expanduser()
        self.max_bytes = max_bytes
        self.space = space
        self.types = list(types)  # the model's layer cache classes
        self.max_pending_bytes = max_pending_bytes
        self.off = False
        self.pending_bytes = 0  # arrays queued for writing (counted by the KV budget)
        self.read_tokens = 0  # prompt tokens served from files
        self._entries: dict[bytes, Entry] = {}
        self._lock = threading.Lock()
        self._writes: list[Future] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-read")
        self._warned: set = set()
        self._open()

    # ---- start-up --------------------------------------------------------

    def _open(self) -> None:
        """The folder made and probed (a start-up error naming the flag if it
        cannot be written), partial writes of stopped processes removed, this
        space's entries indexed (damaged ones deleted), the bound applied."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"--prompt-cache-dir {self.folder}: cannot write there ({e})")
        removed = self._remove_stale_temps()
        if removed:
            log.warning("prompt cache on disk: removed %d partial write(s) left in %s by a "
                        "process that stopped mid-write", removed, self.folder)
        for path in sorted(self.folder.glob(f"pc-{self.space}-*.safetensors")):
            entry = self._indexed(path)
            if entry is not None:
                self._entries[entry.key] = entry
        self._make_room(0)
        log.info("prompt cache on disk: %d entries of this model (%.1f MiB) in %s; the folder "
                 "at most %.1f MiB", len(self._entries),
                 sum(e.nbytes for e in self._entries.values()) / (1 << 20), self.folder,
                 self.max_bytes / (1 << 20))

    def _indexed(self, path: Path) -> Optional[Entry]:
        """``path``'s entry from its header (its arrays stay on disk), or None
        (the damage logged, the file deleted)."""
        try:
            meta, size = read_header(path)
            actual = path.stat().st_size
            if actual != size:
                raise ValueError(f"{actual} bytes where its header says {size} (truncated)")
            if meta.get("format") != str(FORMAT) or meta.get("space") != self.space:
                raise ValueError("written for another model, configuration or format")
            ids = _ids([int(t) for t in meta["tokens"].split(",")])
            if path.name != _entry_name(self.space, ids, int(path.stem.rsplit("-", 1)[1], 16)):
                raise ValueError("its tokens are not the ones its name says")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            self._damaged(path, str(e) or type(e).__name__)
            return None
        return Entry(ids, meta.get("trimmable") == "1", actual, path=path)

    # ---- reading ---------------------------------------------------------

    def lookup(self, tokens) -> tuple[Optional[Entry], int]:
        """The entry serving most of ``tokens`` and how many it serves."""
        if self.off:
            return None, 0
        with self._lock:
            entries = list(self._entries.values())
        return nearest(entries, _ids(tokens))

    def ready(self, tokens) -> bool:
        """False while the entry that would serve ``tokens`` is checked on the
        reader thread (the check started by the first call): the request
        waits and the batch decodes meanwhile. True when nothing needs
        reading: no entry, or its layers still in memory (waiting to be
        written, or held by the memory tier)."""
        entry, n = self.lookup(tokens)
        if not n or entry.cache is not None or entry.in_memory:
            return True
        if entry.check is None:
            entry.check = self._reader.submit(self._check, entry)
        return entry.check.done()

    def load(self, entry: Entry, num_tokens: int) -> Optional[list]:
        """``entry``'s layers (a private copy, the model's own classes) cut
        back to ``num_tokens``; None when it is gone, damaged (logged once,
        the file deleted), unreadable now (logged, the file kept) or not
        checked yet (``ready`` first: the check starts now). On the
        inference thread, which never reads a whole file: it waits only for
        a check already running, which admission allows when nothing else
        decodes."""
        waiting = entry.cache
        try:
            if waiting is not None:  # not written yet: a copy, as the memory tier gives
                cache = native(copy.deepcopy(waiting), self.types)
            else:
                if entry.path is None:
                    return None  # its write failed meanwhile
                check, entry.check = entry.check, None
                if check is None:  # evicted from memory since ``ready``, or ``ready`` not asked
                    entry.check = self._reader.submit(self._check, entry)
                    return None
                problem = check.result()
                if problem is not None:
                    raise Damaged(problem)
                cache = self._read(entry)
            excess = len(entry.ids) - num_tokens
            if excess > 0:
                if not can_trim_prompt_cache(cache):
                    raise Damaged("its layers cannot be cut back")
                trim_prompt_cache(cache, excess)
        except Damaged as e:
            self._forget(entry)
            if entry.path is not None:
                self._damaged(entry.path, str(e))
            return None
        except Exception as e:
            if entry.path is not None and not entry.path.exists():
                self._forget(entry)  # deleted by another server's bound meanwhile
            else:
                log.warning("prompt cache on disk: could not read %s: %s (kept; the request "
                            "prefills)", entry.path.name if entry.path else "an entry",
                            str(e) or type(e).__name__)
            return None
        self.read_tokens += num_tokens
        self.touch(entry)
        return cache

    def _check(self, entry: Entry) -> Optional[str]:
        """Every byte of ``entry``'s file read and summed (the background
        half of a read): None when it matches its name, else what is wrong.
        Raises what reading raises (FileNotFoundError when it is gone)."""
        path = entry.path
        want = int(path.stem.rsplit("-", 1)[1], 16)
        crc = file_crc(path)
        return None if crc == want else f"checksum {crc:08x} where its name says {want:08x}"

    def _read(self, entry: Entry) -> list:
        """The checked file's layers; Damaged when its header, metadata or
        layers are not the entry's."""
        try:
            meta, _ = read_header(entry.path)
            ids = _ids([int(t) for t in meta["tokens"].split(",")])
        except (ValueError, KeyError, TypeError) as e:
            raise Damaged(f"a header that does not parse ({e})") from e
        if meta.get("space") != self.space or ids.tobytes() != entry.key:
            raise Damaged("its metadata names another entry")
        cache = load_prompt_cache(str(entry.path))
        try:
            cache = native(cache, self.types)
        except ValueError as e:
            raise Damaged(str(e)) from e
        for c in cache:
            if isinstance(getattr(c, "offset", None), int) and c.offset != len(entry.ids):
                raise Damaged(f"a layer holds {c.offset} tokens, the entry {len(entry.ids)}")
        mx.eval(_arrays(cache))
        return cache

    # ---- writing ---------------------------------------------------------

    def put(self, tokens, cache: list) -> None:
        """Queue ``cache`` (evaluated; it holds exactly ``tokens``) for
        writing; returns at once. Entries it extends are superseded (deleted
        once it is written), as the memory tier drops them."""
        if self.off or not cache:
            return
        ids = _ids(tokens)
        with self._lock:
            old = self._entries.get(ids.tobytes())
        if old is not None:  # stored already (the same request again)
            old.memory = weakref.ref(cache[0])
            self.touch(old)
            return
        snapshot = portable(cache)
        arrays = _arrays(snapshot)
        size = sum(a.nbytes for a in arrays) + 16 * len(ids) + 256 * len(arrays) + 4096
        # One entry waits whatever its size (one larger than the memory tier
        # still reaches the disk); more wait while they fit max_pending_bytes.
        if size > self.max_bytes or (self.pending_bytes
                                     and self.pending_bytes + size > self.max_pending_bytes):
            log.debug("prompt cache on disk: not writing %d tokens (%d bytes)", len(ids), size)
            return
        entry = Entry(ids, can_trim_prompt_cache(cache), size, cache=snapshot,
                      memory=weakref.ref(cache[0]), queued=size)
        with self._lock:
            self._entries[entry.key] = entry
            self.pending_bytes += size
            self._writes = [f for f in self._writes if not f.done()]
            self._writes.append(self._writer.submit(self._write, entry))

    def _write(self, entry: Entry) -> None:
        try:
            if self.off or self._entries.get(entry.key) is not entry or any(
                    e.path is None and extends(e, entry) for e in self._snapshot()):
                return  # superseded while it waited (a later entry extends it)
            if not self._make_room(entry.nbytes):
                return  # other writers' partial files fill the bound: skip this one
            path = self._save(entry)
            entry.nbytes = path.stat().st_size
            entry.path = path  # before its arrays go: a reader finds one or the other
            # Those it extends go only now: a skipped or failed write leaves them served.
            with self._lock:
                superseded = [e for e in self._entries.values() if extends(entry, e)]
                for e in superseded:
                    del self._entries[e.key]
            for e in superseded:
                if e.path is not None:
                    e.path.unlink(missing_ok=True)
            self._make_room(0)
        except OSError as e:
            if _cannot_write(e):
                self.turn_off(str(e))
            else:
                log.warning("prompt cache on disk: could not write an entry of %d tokens: %s",
                            len(entry.ids), e)
        except Exception:
            log.exception("prompt cache on disk: could not write an entry of %d tokens",
                          len(entry.ids))
        finally:
            with self._lock:
                self.pending_bytes -= entry.queued
                entry.queued, entry.cache = 0, None
            if entry.path is None:
                self._forget(entry)

    def _save(self, entry: Entry) -> Path:
        """Written under a temporary name of this process, locked, synced,
        summed, then renamed: the name appears with the whole file."""
        tmp = self.folder / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.safetensors"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            meta = {"format": str(FORMAT), "space": self.space,
                    "tokens": ",".join(map(str, entry.ids.tolist())),
                    "trimmable": "1" if entry.trimmable else "0"}
            # Through a file object: a full disk is then an OSError (ENOSPC);
            # MLX's own writer, given a name, raises a RuntimeError without errno.
            with os.fdopen(fd, "wb", closefd=False) as f:
                save_prompt_cache(f, entry.cache, meta)
            os.fsync(fd)
            path = self.folder / _entry_name(self.space, entry.ids, file_crc(tmp))
            os.rename(tmp, path)
            return path
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    # ---- the bound -------------------------------------------------------

    def _files(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        for path in [*self.folder.glob(ENTRY_GLOB), *self.folder.glob(f"{TEMP_PREFIX}*")]:
            try:
                out.append((path, path.stat()))
            except FileNotFoundError:
                pass
        return out

    def _remove_stale_temps(self) -> int:
        removed, now = 0, time.time()
        for path in self.folder.glob(f"{TEMP_PREFIX}*"):
            try:
                if now - path.stat().st_mtime > STALE_TEMP_S and not being_written(path):
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def _make_room(self, need: int) -> bool:
        """Delete the oldest entries (any space's) until the folder's files
        and ``need`` more bytes fit the bound; whether they do (other
        writers' partial files may not let them). One listing of the folder
        decides both: a second one would see those files grown meanwhile."""
        self._remove_stale_temps()
        files = self._files()
        total = sum(st.st_size for _, st in files)
        entries = sorted((st.st_mtime, path, st.st_size) for path, st in files
                         if path.name.startswith("pc-"))
        by_path = {e.path: e for e in self._snapshot() if e.path is not None}
        for _, path, size in entries:
            if total + need <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            if path in by_path:
                self._forget(by_path[path])
        return total + need <= self.max_bytes

    # ---- upkeep ----------------------------------------------------------

    def _snapshot(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` used now: the bound deletes the least recently used."""
        if entry.path is not None:
            try:
                os.utime(entry.path)
            except OSError:
                pass

    def _damaged(self, path: Path, problem: str) -> None:
        """One log line per damaged file; the file deleted (when it can be)."""
        if path.name not in self._warned:
            self._warned.add(path.name)
            log.warning("prompt cache on disk: skipped %s: %s (deleted)", path.name, problem)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def turn_off(self, reason: str) -> None:
        """No more reads or writes (the memory tier goes on); warned once."""
        if not self.off:
            self.off = True
            log.warning("prompt cache on disk turned off: %s (%s); the memory tier goes on",
                        reason, self.folder)
        with self._lock:
            self._entries.clear()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued writes (at most ``timeout`` seconds), then stop:
        nothing is read or written after."""
        with self._lock:
            writes = list(self._writes)
        wait(writes, timeout)
        self.off = True
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)


def open_disk_tier(folder: str, max_bytes: int, model, model_path: str,
                   adapter_path: Optional[str], kv_bits: Optional[int], kv_group_size: int,
                   max_pending_bytes: int) -> DiskTier:
    """``model``'s tier in ``folder`` (``model_path`` its folder; a Hugging
    Face repo id is resolved as ``--model`` is)."""
    from ..models.source import resolve_model

    weights_folder, _ = resolve_model(model_path)
    types = [type(c) for c in make_prompt_cache(model)]
    weights = weights_fingerprint(weights_folder, Path(folder).expanduser() / WEIGHT_DIGESTS)
    space = space_key(weights, adapter_fingerprint(adapter_path), kv_bits, kv_group_size,
                      layer_kinds(model))
    return DiskTier(folder, max_bytes, space, types, max_pending_bytes)
