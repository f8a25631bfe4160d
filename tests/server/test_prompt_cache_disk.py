"""The prompt cache's disk tier: entries come back after a restart with the
same output, for every cache kind; a different model or configuration never
reads them; damage is skipped, logged once and deleted; the folder stays
within its bound; writes and checks run off the inference thread."""

import errno
import io
import logging
from collections import deque
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from test_spec_engine import SOURCE, _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving import prompt_cache_disk as disk_module
from mlx_lm_server.serving.kv_budget import KVBudget, LayerCost, admit_in_order
from mlx_lm_server.serving.prompt_cache import PromptCache
from mlx_lm_server.serving.prompt_cache_disk import (DiskTier, file_crc, open_disk_tier,
                                                     read_header, space_key, tokens_served,
                                                     weights_fingerprint)
from mlx_lm_server.serving.request import GenerationRequest

GREEDY = SamplingParams(temperature=0)
LOGGER = "mlx_lm_server.serving.prompt_cache_disk"


# ---- helpers ----------------------------------------------------------------

def _tier(folder, model, path, max_bytes=1 << 30, **kw) -> DiskTier:
    return open_disk_tier(str(folder), max_bytes, model, str(path), kw.get("adapter"),
                          kw.get("kv_bits"), kw.get("kv_group_size", 64), 1 << 30)


def _serve(model, tokenizer, prompt_cache, prompts, max_tokens=12, max_kv_memory=0) -> list:
    """Each prompt answered in turn by a scheduler over ``prompt_cache``,
    which is closed after (its writes finished): [(ids, done)]."""
    s = make_scheduler(model, tokenizer, max_batch_size=8, prompt_cache=prompt_cache,
                       max_kv_memory=max_kv_memory)
    s.start()
    try:
        return [(ids, done) for p in prompts
                for ids, _, done in _run(s, [GenerationRequest(p, max_tokens, GREEDY)])]
    finally:
        s.shutdown()
        s.join(30)


def _entries(folder) -> list:
    return sorted(Path(folder).glob("pc-*.safetensors"))


def _folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


def _layers(num_tokens: int, seed: int, num_layers: int = 2) -> list:
    """Synthetic one-sequence layers holding ``num_tokens`` tokens."""
    keys = mx.random.split(mx.random.key(seed), num_layers)
    out = []
    for i in range(num_layers):
        k, v = mx.random.normal((2, 1, 2, num_tokens, 32), key=keys[i])
        out.append(KVCache.from_state((k, v, num_tokens)))
    mx.eval([c.state[:2] for c in out])
    return out


def _bare_tier(folder, space="a" * 16, max_bytes=1 << 30) -> DiskTier:
    return DiskTier(str(folder), max_bytes, space, [KVCache, KVCache])


def _read_back(tier: DiskTier, tokens) -> tuple[Optional[list], int]:
    """The layers serving ``tokens`` as the scheduler gets them: once the
    background check is done (``ready``), then ``load``."""
    deadline = time.monotonic() + 30
    while not tier.ready(tokens):
        assert time.monotonic() < deadline, "the check never finished"
        time.sleep(0.01)
    entry, n = tier.lookup(tokens)
    return (tier.load(entry, n) if n else None), n


def _flush(tier: DiskTier) -> None:
    with tier._lock:
        writes = list(tier._writes)
    for f in writes:
        f.result(60)


@pytest.fixture(scope="module")
def prompt(smollm2):
    _, tokenizer = smollm2
    return tokenizer.encode("Repeat this code exactly:\n" + SOURCE[:300])


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    """The answer without any cache."""
    model, tokenizer = smollm2
    (ids, _), = _serve(model, tokenizer, None, [prompt])
    return ids


@pytest.fixture
def seeded(tmp_path, smollm2, smollm2_path, prompt, reference):
    """A folder where a first server answered ``prompt`` and stopped."""
    model, tokenizer = smollm2
    (ids, _), = _serve(model, tokenizer, PromptCache(4, 1 << 32, _tier(tmp_path, model, smollm2_path)),
                       [prompt])
    assert ids == reference and len(_entries(tmp_path)) == 1
    return tmp_path


def _after_restart(folder, smollm2, smollm2_path, prompt):
    model, tokenizer = smollm2
    pc = PromptCache(4, 1 << 32, _tier(folder, model, smollm2_path))
    (ids, done), = _serve(model, tokenizer, pc, [prompt])
    return ids, done, pc


# ---- which entry serves -----------------------------------------------------

def test_served_follows_the_memory_tiers_rule():
    t = np.arange(10)
    assert tokens_served(np.arange(6), False, t) == 6  # a prefix, as it is (recurrent too)
    assert tokens_served(np.arange(10), True, t) == 9  # the same: the last token fed again
    assert tokens_served(np.arange(10), False, t) == 0  # ... which a recurrent state cannot be
    assert tokens_served(np.arange(14), True, t) == 9  # longer: cut back
    assert tokens_served(np.arange(14), False, t) == 0
    diverging = np.r_[np.arange(7), [99, 98]]
    assert tokens_served(diverging, True, t) == 7 and tokens_served(diverging, False, t) == 0
    assert tokens_served(np.array([5, 6]), True, t) == 0


# ---- a restart --------------------------------------------------------------

def test_a_restart_serves_the_prompt_from_disk_with_the_same_answer(seeded, smollm2,
                                                                      smollm2_path, prompt,
                                                                      reference):
    ids, done, pc = _after_restart(seeded, smollm2, smollm2_path, prompt)
    assert done.cached_tokens == len(prompt) - 1
    assert pc.disk.read_tokens == len(prompt) - 1
    assert ids == reference


def test_a_follow_up_after_a_restart_reads_the_first_turn(seeded, smollm2, smollm2_path,
                                                          prompt, reference):
    """The stored entry holds the prompt and the reply; the next turn extends
    both, and the entry written for it supersedes the first (deleted)."""
    model, tokenizer = smollm2
    second = prompt + reference + tokenizer.encode("\nOnce more:")
    (want, _), = _serve(model, tokenizer, None, [second])
    first_file, = _entries(seeded)
    ids, done, _ = _after_restart(seeded, smollm2, smollm2_path, second)
    assert done.cached_tokens == len(prompt) + len(reference) and ids == want
    assert len(_entries(seeded)) == 1 and not first_file.exists()


@pytest.fixture(scope="module")
def families(tmp_path_factory, smollm2_path):
    """Sliding-window rings (gemma3_text) and recurrent states (qwen3_5)."""
    from tiny_models import build

    root = tmp_path_factory.mktemp("disk-families")
    paths = {f: build(f, root / f, smollm2_path, s)
             for f, s in (("gemma3_text", 0.5), ("qwen3_5", 1.0))}
    return {f: (p, *load(str(p))) for f, p in paths.items()}


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5", "quantized"])
def test_every_cache_kind_comes_back_from_disk(family, families, tiny_qwen3_path, tmp_path):
    """Rings and recurrent states at the position they were stored, quantized
    rows as the model's own class: the next turn after a restart starts from
    the first turn's layers and says what it says without a cache."""
    if family == "quantized":
        from mlx_lm_server.kv.quantized import QuantizedRowCache, quantize_kv_caches

        path = tiny_qwen3_path
        model, tokenizer = load(str(path))
        quantize_kv_caches(model, 8, 32)
        assert type(make_prompt_cache(model)[0]) is QuantizedRowCache
        kw = {"kv_bits": 8, "kv_group_size": 32}
    else:
        path, model, tokenizer = families[family]
        kw = {}
    first = tokenizer.encode("Repeat: " + SOURCE[:200])
    (reply, _), = _serve(model, tokenizer, PromptCache(4, 1 << 32, _tier(tmp_path, model, path, **kw)),
                         [first], 16)
    second = first + reply + tokenizer.encode(" and again: " + SOURCE[:50])
    (want, _), = _serve(model, tokenizer, None, [second], 16)
    pc = PromptCache(4, 1 << 32, _tier(tmp_path, model, path, **kw))
    (got, done), = _serve(model, tokenizer, pc, [second], 16)
    assert done.cached_tokens == len(first) + len(reply) == pc.disk.read_tokens
    assert got == want


# ---- the key -----------------------------------------------------------------

def test_the_space_names_weights_adapter_kv_bits_and_cache_kinds(tiny_qwen3_path, tmp_path):
    copy = shutil.copytree(tiny_qwen3_path, tmp_path / "copy")
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_qwen3_path)
    weights = mx.load(str(copy / "model.safetensors"))
    mx.save_safetensors(str(copy / "model.safetensors"), {k: v + 1 for k, v in weights.items()})
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_qwen3_path)

    base = ("w", "none", None, 64, ["KVCache"] * 2)
    key = space_key(*base)
    assert key == space_key(*base)
    for i, other in ((0, "w2"), (1, "adapter"), (2, 8), (4, ["KVCache", "ArraysCache"])):
        changed = list(base)
        changed[i] = other
        assert space_key(*changed) != key, i
    assert space_key("w", "none", 8, 32, base[4]) != space_key("w", "none", 8, 64, base[4])
    assert space_key("w", "none", 4, 64, base[4]) != space_key("w", "none", 8, 64, base[4])


def _weights_folder(folder: Path) -> Path:
    """A model folder: a config and one 8 MiB weight file."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    w = mx.random.normal((2048, 1024), key=mx.random.key(0))
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": w})
    return folder


def test_weights_that_differ_only_between_sampled_slices_have_another_key(tmp_path):
    """A LoRA fused into its base keeps names, sizes, headers and config and
    changes some bytes; here 64 in the middle of the file, between the 17
    slices of 64 KiB a sampling fingerprint would read."""
    base = _weights_folder(tmp_path / "base")
    tuned = shutil.copytree(base, tmp_path / "tuned")
    path = tuned / "model.safetensors"
    data = bytearray(path.read_bytes())
    size = len(data)
    at = (size * 8 // 17 + (1 << 16) + size * 9 // 17) // 2
    for i in range(at, at + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    before = (base / "model.safetensors").read_bytes()
    slices = [slice(size * i // 17, size * i // 17 + (1 << 16)) for i in range(17)]
    assert all(before[s] == data[s] for s in slices) and before != data
    assert read_header(path) == read_header(base / "model.safetensors")
    assert weights_fingerprint(tuned) != weights_fingerprint(base)
    kinds = ["KVCache"] * 2
    assert space_key(weights_fingerprint(tuned), "none", None, 64, kinds) != \
        space_key(weights_fingerprint(base), "none", None, 64, kinds)


def test_a_weight_files_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """Read whole once: remembered by the process, and across a restart in a
    file of the tier's folder (a damaged one is ignored); a file touched,
    grown or rewritten in place (its time put back) is read again."""
    model = _weights_folder(tmp_path / "model")
    remembered = tmp_path / "tier" / "weights.json"
    path = model / "model.safetensors"
    hashed, digest = [], disk_module.file_digest
    monkeypatch.setattr(disk_module, "file_digest", lambda p: hashed.append(p) or digest(p))

    def fingerprint(restart: bool = False) -> str:
        if restart:
            disk_module._DIGESTS.clear()
        return weights_fingerprint(model, remembered)

    first = fingerprint()
    assert hashed == [path] and fingerprint() == first and len(hashed) == 1
    assert fingerprint(restart=True) == first and len(hashed) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert fingerprint() == first and len(hashed) == 2
    assert fingerprint(restart=True) == first and len(hashed) == 2

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as a copy that keeps times
    changed = fingerprint()
    assert changed != first and len(hashed) == 3
    with path.open("ab") as f:
        f.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint() != changed and len(hashed) == 4

    remembered.write_text("{not json")
    again = fingerprint(restart=True)
    assert len(hashed) == 5 and fingerprint(restart=True) == again and len(hashed) == 5


def test_another_models_entries_are_never_read(seeded, smollm2, tiny_qwen3_path, caplog):
    """Its files have another space: ignored (not deleted, not logged)."""
    model, _ = load(str(tiny_qwen3_path))
    tier = _tier(seeded, model, tiny_qwen3_path)
    theirs, = _entries(seeded)
    assert tier.space not in theirs.name
    assert tier.lookup(list(range(400))) == (None, 0) and not tier._entries
    assert theirs.exists() and not _warnings(caplog)


# ---- damage ------------------------------------------------------------------

def test_a_truncated_file_is_skipped_once_and_deleted(seeded, smollm2, smollm2_path, prompt,
                                                       reference, caplog):
    path, = _entries(seeded)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    ids, done, _ = _after_restart(seeded, smollm2, smollm2_path, prompt)
    assert ids == reference and done.cached_tokens == 0
    warned = _warnings(caplog)
    assert len(warned) == 1 and "truncated" in warned[0] and path.name in warned[0]
    # Deleted, and the same entry written again, whole, by this answer.
    assert path.stat().st_size == len(data) and file_crc(path) == int(path.stem[-8:], 16)


def test_flipped_bytes_in_a_block_are_caught_by_the_checksum(seeded, smollm2, smollm2_path,
                                                             prompt, reference, caplog):
    path, = _entries(seeded)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    model, tokenizer = smollm2
    pc = PromptCache(4, 1 << 32, _tier(seeded, model, smollm2_path))
    assert len(pc.disk._entries) == 1  # its header is whole: only reading tells
    (ids, done), (again, done2) = _serve(model, tokenizer, pc, [prompt, prompt])
    assert ids == again == reference and done.cached_tokens == 0
    assert done2.cached_tokens == len(prompt) - 1  # the first answer's own entry, in memory
    warned = _warnings(caplog)
    assert len(warned) == 1 and "checksum" in warned[0]
    # Deleted, and the same entry written again, whole, by the first answer.
    assert bytes(data) != path.read_bytes() and file_crc(path) == int(path.stem[-8:], 16)


def test_a_file_of_another_model_under_this_models_name_is_skipped(seeded, smollm2,
                                                                   smollm2_path, tiny_qwen3_path,
                                                                   prompt, reference, caplog):
    """Another model's entry renamed into this model's space."""
    model, _ = load(str(tiny_qwen3_path))
    ours = _tier(seeded, model, tiny_qwen3_path).space
    path, = _entries(seeded)
    theirs = path.parent / path.name.replace(path.name.split("-")[1], ours)
    path.rename(theirs)
    caplog.clear()
    tier = _tier(seeded, model, tiny_qwen3_path)
    warned = _warnings(caplog)
    assert not tier._entries and len(warned) == 1 and "another model" in warned[0]
    assert not theirs.exists()


@pytest.mark.parametrize("error", [errno.EACCES, errno.ENOSPC])
def test_a_folder_that_cannot_be_written_while_serving_turns_the_tier_off(
        error, tmp_path, smollm2, smollm2_path, prompt, reference, monkeypatch, caplog):
    """Made read-only (as root, whom permissions do not stop, the kernel's
    answer is given), or full: one warning, the memory tier goes on."""
    model, tokenizer = smollm2
    pc = PromptCache(4, 1 << 32, _tier(tmp_path, model, smollm2_path))
    if error == errno.EACCES:
        os.chmod(tmp_path, 0o555)
    if error != errno.EACCES or os.geteuid() == 0:
        def refuse(self, entry):
            raise OSError(error, os.strerror(error), str(tmp_path))

        monkeypatch.setattr(DiskTier, "_save", refuse)
    try:
        second = prompt + tokenizer.encode(" Again:")
        (ids, _), (more, done) = _serve(model, tokenizer, pc, [prompt, second])
    finally:
        os.chmod(tmp_path, 0o755)
    (want, _), = _serve(model, tokenizer, None, [second])
    assert ids == reference and more == want and done.cached_tokens == len(prompt)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "turned off" in warned[0] and pc.disk.off
    assert not _entries(tmp_path)


@pytest.mark.parametrize("error", [MemoryError, PermissionError])
def test_a_transient_error_reading_an_entry_keeps_its_file(error, tmp_path, monkeypatch,
                                                            caplog):
    """Out of memory loading it, or a permission refused while checking it,
    proves nothing about the file: kept (and indexed), one warning, the
    request prefills; it is served once the error is gone."""
    tokens, kept = list(range(300)), _layers(300, 0)
    tier = _bare_tier(tmp_path)
    tier.put(tokens, kept)
    tier.close()
    path, = _entries(tmp_path)
    restarted = _bare_tier(tmp_path)

    def fail(*args, **kwargs):
        raise error("refused for the test")

    monkeypatch.setattr(disk_module, "load_prompt_cache" if error is MemoryError else "file_crc",
                        fail)
    assert _read_back(restarted, tokens + [1]) == (None, 300)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "refused for the test" in warned[0]
    assert "deleted" not in warned[0] and path.exists()
    monkeypatch.undo()
    got, n = _read_back(restarted, tokens + [1])
    assert n == 300 and mx.array_equal(got[1].state[1], kept[1].state[1]).item()
    restarted.close()


class _FillsAt64KiB(io.FileIO):
    """A file whose disk is full after 64 KiB: what a write raises then."""

    def write(self, data):
        if self.tell() + len(data) > 64 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_a_full_disk_inside_mlxs_writer_turns_the_tier_off_once(tmp_path, caplog, monkeypatch):
    """A 64 KiB disk fills during the write of a 300 KiB entry: one warning,
    no traceback, the tier off, the partial file gone. (MLX's own writer,
    given a file name, reports this as a RuntimeError without an errno.) A
    real 64 KiB tmpfs where this machine lets the test mount one; else the
    disk fills at the file the tier writes through."""
    full = tmp_path / "full"
    full.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                           capture_output=True)
    if mount.returncode:
        monkeypatch.setattr(disk_module.os, "fdopen",
                            lambda fd, mode, closefd=True: _FillsAt64KiB(fd, mode, closefd))
    try:
        tier = _bare_tier(full)
        for i in range(3):
            tier.put([i] + list(range(300)), _layers(301, i))
            _flush(tier)
        logged = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
        assert len(logged) == 1 and "turned off" in logged[0].getMessage(), \
            [r.getMessage() for r in logged]
        assert "No space left" in logged[0].getMessage() and logged[0].exc_info is None
        assert tier.off and not list(full.iterdir())
        tier.close()
    finally:
        if not mount.returncode:
            subprocess.run(["umount", str(full)], check=True)


def test_an_unwritable_folder_on_the_command_line_is_a_start_up_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = build_parser().parse_args(["--model", "m", "--prompt-cache-dir", str(blocker / "x")])
    with pytest.raises(ValueError, match="--prompt-cache-dir"):
        config_from_args(args)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        args = build_parser().parse_args(["--model", "m", "--prompt-cache-dir", str(locked)])
        with pytest.raises(ValueError, match="--prompt-cache-dir .* not writable"):
            config_from_args(args)
    args = build_parser().parse_args(["--model", "m", "--prompt-cache-dir", str(tmp_path / "new"),
                                      "--prompt-cache-disk-bytes", "2G"])
    config = config_from_args(args)
    assert config.prompt_cache_disk_bytes == 2 << 30 and not (tmp_path / "new").exists()
    args = build_parser().parse_args(["--model", "m", "--prompt-cache-dir", str(tmp_path),
                                      "--prompt-cache-size", "0"])
    with pytest.raises(ValueError, match="--prompt-cache-size"):
        config_from_args(args)


_CRASHING_WRITER = """
import os, sys, time
from mlx_lm.models.cache import KVCache
import mlx.core as mx
from mlx_lm_server.serving import prompt_cache_disk as d

real = d.save_prompt_cache
def half_then_hang(f, cache, metadata):
    real(f, cache, metadata)
    f.flush()
    os.ftruncate(f.fileno(), f.tell() // 2)
    time.sleep(600)
d.save_prompt_cache = half_then_hang
tier = d.DiskTier(sys.argv[1], int(sys.argv[2]), "a" * 16, [KVCache, KVCache])
k = mx.random.normal((1, 2, 3000, 32))
tier.put(list(range(1000, 4000)), [KVCache.from_state((k, k, 3000))] * 2)
time.sleep(600)
"""


def test_kill_9_during_a_write_then_a_restart(tmp_path, caplog):
    """A complete entry written before survives; the partial write is kept
    while it may still be live (under a minute old), counted in the bound,
    and removed at the next start once older, with one log line."""
    bound = 8 << 20
    tier = _bare_tier(tmp_path, max_bytes=bound)
    kept = _layers(800, 0)
    tier.put(list(range(800)), kept)
    _flush(tier)
    tier.close()
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(tmp_path), str(bound)])
    try:
        deadline = time.monotonic() + 120
        while not [p for p in tmp_path.glob(".pc-tmp-*") if p.stat().st_size > 0]:
            assert time.monotonic() < deadline and proc.poll() is None, "no write started"
            time.sleep(0.05)
        time.sleep(0.3)  # truncated, hanging
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial, = tmp_path.glob(".pc-tmp-*")
    young = _bare_tier(tmp_path, max_bytes=bound)
    assert partial.exists() and _folder_bytes(tmp_path) <= bound
    assert not _warnings(caplog)
    old = time.time() - 2 * disk_module.STALE_TEMP_S
    os.utime(partial, (old, old))
    restarted = _bare_tier(tmp_path, max_bytes=bound)
    warned = _warnings(caplog)
    assert not partial.exists() and len(warned) == 1 and "partial write" in warned[0]
    got, n = _read_back(restarted, list(range(800)) + [5])
    assert n == 800 and mx.array_equal(got[0].state[0], kept[0].state[0]).item()
    young.close()
    restarted.close()


def test_a_locked_partial_write_is_never_removed(tmp_path):
    """Another live writer's file, however old it looks."""
    import fcntl

    partial = tmp_path / ".pc-tmp-1-live.safetensors"
    partial.write_bytes(b"x" * 1000)
    old = time.time() - 10 * disk_module.STALE_TEMP_S
    os.utime(partial, (old, old))
    with partial.open("rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _bare_tier(tmp_path).close()
        assert partial.exists()
    _bare_tier(tmp_path).close()
    assert not partial.exists()


# ---- the bound ------------------------------------------------------------------

def test_thirty_long_prefixes_through_a_smaller_bound(tmp_path):
    """The folder, watched while it is written, never holds more than the
    bound; the newest entries are still served from disk after a restart."""
    num_tokens, bound = 1000, 6 << 20
    tier = _bare_tier(tmp_path, max_bytes=bound)
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                most[0] = max(most[0], _folder_bytes(tmp_path))
            except FileNotFoundError:
                pass
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    prompts, layers = [], []
    try:
        for i in range(30):
            prompts.append([10_000 + i] + list(range(num_tokens - 1)))
            layers.append(_layers(num_tokens, i))
            tier.put(prompts[-1], layers[-1])
            _flush(tier)
    finally:
        stop.set()
        watcher.join()
    total = sum(a.nbytes for c in layers for a in c[0].state[:2]) * 2
    assert total > 4 * bound and 0 < most[0] <= bound, (total, most[0], bound)
    tier.close()
    restarted = _bare_tier(tmp_path, max_bytes=bound)
    got, n = _read_back(restarted, prompts[-1] + [1])
    assert n == num_tokens and mx.array_equal(got[1].state[1], layers[-1][1].state[1]).item()
    assert restarted.lookup(prompts[0] + [1]) == (None, 0)
    restarted.close()


def test_two_servers_on_one_folder_share_the_bound_without_damage(tmp_path):
    """Two tiers (two models, or two servers) whose writer threads race on
    one folder: every file left is whole and matches its checksum, the
    folder within the bound."""
    bound = 5 << 20
    tiers = [_bare_tier(tmp_path, s * 16, bound) for s in "ab"]
    for i in range(12):
        for seed, tier in enumerate(tiers, 1):
            tier.put([seed, i] + list(range(500)), _layers(502, seed * 100 + i))
    for t in tiers:
        t.close()
    left = _entries(tmp_path)
    assert left and _folder_bytes(tmp_path) <= bound
    for path in left:
        assert file_crc(path) == int(path.stem.rsplit("-", 1)[1], 16)
    for s, seed in (("a", 1), ("b", 2)):
        reopened = _bare_tier(tmp_path, s * 16, bound)
        got, n = _read_back(reopened, [seed, 11] + list(range(500)) + [7])
        assert n == 502 and got is not None
        reopened.close()


def test_an_entry_stays_until_the_one_extending_it_is_written(tmp_path, monkeypatch, caplog):
    """A write that fails (an I/O error: the tier stays on) leaves the entry
    it would have superseded indexed and served, and every file on disk
    indexed; once written, the longer one replaces it."""
    first = list(range(300))
    tier = _bare_tier(tmp_path)
    tier.put(first, _layers(300, 0))
    _flush(tier)
    path, = _entries(tmp_path)

    def fail(self, entry):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(DiskTier, "_save", fail)
    longer = first + [7, 8]
    tier.put(longer, _layers(302, 1))
    _flush(tier)
    assert not tier.off and len(_warnings(caplog)) == 1
    assert tier.lookup(first + [1])[1] == 300 and path.exists()
    assert {e.path for e in tier._snapshot()} == set(_entries(tmp_path))
    monkeypatch.undo()
    tier.put(longer, _layers(302, 1))
    _flush(tier)
    written, = _entries(tmp_path)
    assert not path.exists() and tier.lookup(first + [1])[1] == 300
    assert [e.path for e in tier._snapshot()] == [written]
    tier.close()


# ---- off the inference thread -----------------------------------------------------

def test_writes_and_checks_run_on_threads_of_their_own(tmp_path, monkeypatch):
    names, gate = [], threading.Event()
    save, check = DiskTier._save, DiskTier._check

    def saving(self, entry):
        names.append(threading.current_thread().name)
        return save(self, entry)

    def checking(self, entry):
        names.append(threading.current_thread().name)
        gate.wait(30)
        return check(self, entry)

    monkeypatch.setattr(DiskTier, "_save", saving)
    monkeypatch.setattr(DiskTier, "_check", checking)
    tokens = list(range(300))
    tier = _bare_tier(tmp_path)
    tier.put(tokens, _layers(300, 0))
    tier.close()
    restarted = _bare_tier(tmp_path)
    assert not restarted.ready(tokens + [1])  # the check started, held at the gate
    assert not restarted.ready(tokens + [1])
    gate.set()
    deadline = time.monotonic() + 30
    while not restarted.ready(tokens + [1]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    entry, n = restarted.lookup(tokens + [1])
    assert restarted.load(entry, n) is not None and n == 300
    assert names[0].startswith("prompt-cache-write") and names[1].startswith("prompt-cache-read")
    assert len(names) == 2  # the load used the check's verdict
    restarted.close()


@pytest.mark.parametrize("max_kv_memory", [0, 1 << 30])
def test_a_disk_hit_is_checked_off_the_inference_thread_with_or_without_a_budget(
        max_kv_memory, seeded, smollm2, smollm2_path, prompt, reference, monkeypatch):
    """Every byte summed on the reader thread, never on the thread that
    loads (the inference thread): without a KV budget too, and with one when
    nothing else decodes. The answer is the one without a cache."""
    crc_threads, load_threads = [], []
    crc, load_entry = disk_module.file_crc, DiskTier.load

    def summing(path):
        crc_threads.append(threading.get_ident())
        return crc(path)

    def loading(self, entry, num_tokens):
        load_threads.append(threading.get_ident())
        return load_entry(self, entry, num_tokens)

    monkeypatch.setattr(disk_module, "file_crc", summing)
    monkeypatch.setattr(DiskTier, "load", loading)
    model, tokenizer = smollm2
    pc = PromptCache(4, 1 << 32, _tier(seeded, model, smollm2_path))
    (ids, done), = _serve(model, tokenizer, pc, [prompt], max_kv_memory=max_kv_memory)
    assert ids == reference and done.cached_tokens == len(prompt) - 1 == pc.disk.read_tokens
    assert load_threads and crc_threads and not set(load_threads) & set(crc_threads)


def test_an_entry_of_this_process_gone_from_memory_is_checked_in_the_background(
        tmp_path, monkeypatch):
    """Written by this process, then evicted from the memory tier: not
    ready until its background check is done, and never summed on the
    caller's thread."""
    crc_threads, crc = [], disk_module.file_crc
    monkeypatch.setattr(disk_module, "file_crc",
                        lambda path: crc_threads.append(threading.get_ident()) or crc(path))
    pc = PromptCache(4, 1 << 32, _bare_tier(tmp_path))
    tokens, layers = list(range(300)), _layers(300, 0)
    want = layers[0].state[0]
    pc.store(tokens, layers)
    del layers  # held by the memory tier alone, as the scheduler leaves them
    _flush(pc.disk)
    assert pc.ready(tokens + [1])  # in memory: nothing to read
    pc.evict_to(0)
    assert len(pc) == 0
    deadline = time.monotonic() + 30
    while not pc.ready(tokens + [1]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cache, n = pc.fetch(tokens + [1])
    assert n == 300 and mx.array_equal(cache[0].state[0], want).item()
    assert len(crc_threads) == 2 and threading.get_ident() not in crc_threads  # write, check
    pc.close()


@pytest.mark.parametrize("budget", [None, KVBudget(1 << 30, [LayerCost(per_token=64)])])
def test_admission_holds_a_request_whose_prefix_is_read_while_others_decode(budget):
    """With a KV budget or without; asked even when nothing decodes (the
    read starts, and the join waits for it)."""
    class Reading:
        nbytes, ready_now, asked = 0, False, 0

        def ready(self, tokens):
            self.asked += 1
            return self.ready_now

    def handle():
        return type("H", (), {"request": GenerationRequest([1, 2, 3], 4, GREEDY)})()

    cache, joined, rows = Reading(), [], {1: "a row decoding"}
    join = joined.append
    waiting = deque([handle()])
    admit_in_order(budget, waiting, cache, join, rows)
    assert not joined and len(waiting) == 1
    cache.ready_now = True
    admit_in_order(budget, waiting, cache, join, rows)
    assert len(joined) == 1
    waiting.append(handle())
    cache.ready_now = False
    rows.clear()  # nothing decodes: it joins, the read finishes in the join
    admit_in_order(budget, waiting, cache, join, rows)
    assert len(joined) == 2 and cache.asked == 3


def test_entries_waiting_for_the_disk_count_in_the_prompt_caches_bytes(tmp_path, monkeypatch):
    gate, save = threading.Event(), DiskTier._save

    def held(self, entry):
        gate.wait(30)
        return save(self, entry)

    monkeypatch.setattr(DiskTier, "_save", held)
    pc = PromptCache(4, 1 << 32, _bare_tier(tmp_path))
    layers = _layers(400, 0)
    size = sum(c.nbytes for c in layers)
    pc.store(list(range(400)), layers)
    assert pc.disk.pending_bytes >= size and pc.nbytes == size + pc.disk.pending_bytes
    pc.evict_to(pc.disk.pending_bytes)  # what waits for the disk counts first
    assert len(pc) == 0
    # Evicted from memory, still served: its arrays wait to be written.
    cache, n = pc.fetch(list(range(400)) + [1])
    assert n == 400 and mx.array_equal(cache[0].state[0], layers[0].state[0]).item()
    gate.set()
    pc.close()
    assert pc.disk.pending_bytes == 0 and len(_entries(tmp_path)) == 1


def test_one_entry_waits_for_the_disk_whatever_its_size_more_only_within_the_cap(
        tmp_path, monkeypatch):
    """An entry larger than the memory tier (the cap on waiting arrays)
    still reaches the disk; a second one queued behind it is not kept
    waiting past the cap."""
    gate, save = threading.Event(), DiskTier._save

    def held(self, entry):
        gate.wait(30)
        return save(self, entry)

    monkeypatch.setattr(DiskTier, "_save", held)
    tier = DiskTier(str(tmp_path), 1 << 30, "a" * 16, [KVCache, KVCache], max_pending_bytes=1)
    tier.put(list(range(300)), _layers(300, 0))
    tier.put([7] + list(range(300)), _layers(301, 1))
    gate.set()
    _flush(tier)
    written, = _entries(tmp_path)
    assert tier.lookup(list(range(300)) + [1])[1] == 300
    assert tier.lookup([7] + list(range(300)) + [1]) == (None, 0)
    tier.close()


# ---- one server, restarted ---------------------------------------------------------

def test_a_restarted_server_answers_from_its_prompt_cache_dir(smollm2_path, tmp_path):
    from conftest import LiveServer

    body = {"max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Explain this code:\n" + SOURCE[:600]}]}
    answers = []
    for _ in range(2):
        server = LiveServer(smollm2_path, prompt_cache_dir=str(tmp_path))
        try:
            r = httpx.post(server.url + "/v1/chat/completions",
                           json={**body, "model": server.model}, timeout=300).json()
        finally:
            server.close()
        answers.append(r)
    first, second = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        second["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
