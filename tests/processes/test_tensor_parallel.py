"""Tensor parallel over two ranks on loopback: the server as users start it.

Ranks are started directly (``MLX_RANK``, ``MLX_HOSTFILE``), as ``mlx.launch``
would start them, which is faster here; one test goes through ``mlx.launch``
exactly as the README says. Lossless means "speculation on = speculation off
under the same split": a split model may differ from one process from the
first token (reduction order).
"""

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mlx_lm_server.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "mlx_lm_server.server"]
CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i}" for i in range(10))


class TwoRanks:
    """``mlx-lm-server`` as rank 0 and rank 1 of a two-process ring on loopback."""

    def __init__(self, tmp: Path, model: Path, *args: str, name: str = "tp"):
        self.port, p1, p2 = free_ports(3)
        hostfile = tmp / f"{name}-hosts.json"
        hostfile.write_text(json.dumps([f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"]))
        self.logs = [tmp / f"{name}-rank{r}.log" for r in (0, 1)]
        self.procs = []
        for rank in (1, 0):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            with open(self.logs[rank], "w") as log:
                self.procs.insert(0, subprocess.Popen(
                    SERVER + ["--model", str(model), "--port", str(self.port), *args],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model.name
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a rank exited during start-up:\n{self.log(0)}\n{self.log(1)}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the two-rank server did not start")

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def complete(self, prompt: str, **body) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=300,
                       json={"model": self.model, "prompt": prompt, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self, content: str, **body) -> dict:
        r = httpx.post(self.url + "/v1/chat/completions", timeout=300, json={
            "model": self.model, "messages": [{"role": "user", "content": content}], **body})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self, timeout: float = 60.0) -> list[int]:
        """SIGTERM to rank 0; both exit statuses."""
        self.procs[0].send_signal(signal.SIGTERM)
        return [p.wait(timeout) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def two_ranks(tmp_path):
    started = []

    def start(model, *args, name="tp"):
        started.append(TwoRanks(tmp_path, model, *args, name=name))
        return started[-1]

    yield start
    for s in started:
        s.kill()


def _final_checksums(ranks: TwoRanks) -> list[str]:
    """The checksum each rank logged when it stopped (rank 0 last stops the others)."""
    out = []
    for r in (0, 1):
        found = re.findall(r"stopped .* after plan (\d+): checksum ([0-9a-f]{8})", ranks.log(r))
        assert found, ranks.log(r)
        out.append(found[-1])
    return out


def _parallel(fn, items, workers=8):
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


def _stream_and_cancel(url: str, body: dict, after_chunks: int) -> int:
    """Stream a completion and drop the connection after some chunks."""
    got = 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got += 1
                if got >= after_chunks:
                    break
    return got


def test_a_model_that_cannot_be_split_is_refused_naming_its_heads(tmp_path, smollm2_path):
    from mlx_lm_server.parallel.distributed import split_problem

    problem = split_problem(str(smollm2_path), 2)
    assert "num_attention_heads = 9" in problem and "num_key_value_heads = 3" in problem
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([f"127.0.0.1:{p}" for p in free_ports(2)]))
    procs = [subprocess.Popen(SERVER + ["--model", str(smollm2_path), "--port", "0"], cwd=ROOT,
                              env=dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 2, out
        assert "cannot be split over 2 ranks" in out and "num_attention_heads = 9" in out


def test_lockstep_through_joins_cancels_stops_and_long_prompts(two_ranks, tiny_qwen3_path):
    """A tiny qwen3 (4 heads, 2 KV heads) with n-gram speculation: greedy
    outputs equal plain decoding under the same split, stops inside accepted
    runs, cancelled streams, a prompt past one plan's 4 KiB, seeded sampling
    reproducible; both ranks end with the same checksum."""
    plain = two_ranks(tiny_qwen3_path, "--spec-decode", "none", name="none")
    prompts = [f"Item {i}: the quick brown fox number {i} jumps" for i in range(8)]
    body = {"max_tokens": 48, "temperature": 0}
    want = _parallel(lambda p: plain.complete(p, **body)["choices"][0]["text"], prompts)
    assert plain.stop() == [0, 0]
    a, b = _final_checksums(plain)
    assert a == b

    tp = two_ranks(tiny_qwen3_path, "--spec-decode", "ngram", "--max-batch-size", "8",
                   name="ngram")
    got = _parallel(lambda p: tp.complete(p, **body)["choices"][0]["text"], prompts)
    assert got == want
    metrics = httpx.get(tp.url + "/v1/spec_decode/metrics", timeout=5).json()
    assert metrics["totals"]["accepted_tokens"] > 0, metrics

    # A stop string from the middle of a long accepted run ends the text there.
    text = want[0]
    stop = text[len(text) // 2: len(text) // 2 + 6]
    cut = tp.complete(prompts[0], stop=[stop], **body)
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"

    # Streams cancelled mid-generation while others run; a prompt past 4 KiB.
    long_prompt = " ".join(f"w{i}" for i in range(440))  # ~1,900 tokens, ~5 KiB pickled
    assert len(tp.complete(long_prompt, max_tokens=4, temperature=0)["choices"][0]["text"]) > 0
    seeded = {"max_tokens": 24, "temperature": 1.0, "seed": 7}
    first = tp.complete(prompts[1], **seeded)["choices"][0]["text"]
    cancelled = _parallel(
        lambda i: _stream_and_cancel(tp.url, {"model": tp.model, "prompt": prompts[i],
                                              "max_tokens": 2000, "temperature": 0},
                                     after_chunks=3 + i), range(6))
    assert all(n >= 3 for n in cancelled)
    again = _parallel(lambda p: tp.complete(p, **seeded)["choices"][0]["text"],
                      [prompts[1], prompts[2], prompts[1]])
    assert again[0] == again[2] == first  # the same draws whatever shares the batch
    # Unseeded sampling: every rank must still draw the same tokens (rank 0
    # gives the request a seed), or the checksums below part.
    _parallel(lambda p: tp.complete(p, max_tokens=40, temperature=1.0), prompts[:4])

    deadline = time.monotonic() + 30
    while tp.health()["sequences"] and time.monotonic() < deadline:
        time.sleep(0.2)
    health = tp.health()
    assert health["sequences"] == 0 and health["tensor_parallel"]["ranks"] == 2
    assert tp.stop() == [0, 0]
    (plans0, sum0), (plans1, sum1) = _final_checksums(tp)
    assert (plans0, sum0) == (plans1, sum1)
    assert int(plans0) > 64  # at least one comparison ran while serving
    assert "lock-step ok" in tp.log(0) and "lock-step ok" in tp.log(1)


def test_draft_model_trees_on_rank_0_match_plain_under_the_split(two_ranks, tiny_qwen3_path,
                                                                smollm2_path):
    """SmolLM2 (not split: it runs on rank 0 alone) drafts trees for the
    split tiny qwen3 (every step: three children a node, k=4 nodes); both
    ranks verify rank 0's trees (its parent links travel in the step plan)
    and keep the same path: greedy outputs equal the same split's plain
    decoding, and the ranks' final caches are the same."""
    prompts = [f"Story {i}: once upon a time" for i in range(4)]
    body = {"max_tokens": 20, "temperature": 0}
    plain = two_ranks(tiny_qwen3_path, "--spec-decode", "none", name="none")
    want = _parallel(lambda p: plain.complete(p, **body)["choices"][0]["text"], prompts)
    plain.stop()
    tp = two_ranks(tiny_qwen3_path, "--spec-decode", "draft", "--draft-model",
                   str(smollm2_path), "--num-speculative-tokens", "4", "--spec-tree-width", "3",
                   "--no-spec-decode-dynamic", "--no-adaptive-k", name="draft")
    got = _parallel(lambda p: tp.complete(p, **body)["choices"][0]["text"], prompts)
    assert got == want
    metrics = httpx.get(tp.url + "/v1/spec_decode/metrics", timeout=5).json()
    assert metrics["totals"]["draft_tokens"] > 0, metrics
    assert metrics["trees"]["steps"] > 0 and metrics["trees"]["nodes_per_row"] > 1, metrics
    assert "loading draft" not in tp.log(1).lower()
    assert tp.stop() == [0, 0]
    a, b = _final_checksums(tp)
    assert a == b


QWEN_PROMPTS = [f"Rename f{i} to g{i}; return the whole code.\n{CODE}" for i in range(8)]


def _qwen_outputs(two_ranks, qwen05_path, mode: str, *args: str) -> list[str]:
    tp = two_ranks(qwen05_path, "--spec-decode", mode, *args, name=mode)
    outs = _parallel(lambda p: tp.chat(p, max_tokens=40, temperature=0)
                     ["choices"][0]["message"]["content"], QWEN_PROMPTS)
    assert tp.stop() == [0, 0]
    return outs


@pytest.mark.slow  # long by nature (Qwen on two ranks); the tiny qwen3 lock-step test stays
def test_qwen_ngram_greedy_parity_under_two_ranks(two_ranks, qwen05_path):
    """The real model: 8 simultaneous code-edit requests, n-gram on, equal
    the two-rank server with speculation off."""
    none = _qwen_outputs(two_ranks, qwen05_path, "none")
    assert _qwen_outputs(two_ranks, qwen05_path, "ngram") == none


@pytest.mark.slow
def test_qwen_draft_greedy_parity_and_single_process_report(two_ranks, qwen05_path):
    """The same model drafting for itself from rank 0 equals the split's
    plain decoding; how many outputs match one process is reported only
    (the split changes the reduction order)."""
    none = _qwen_outputs(two_ranks, qwen05_path, "none")
    draft = _qwen_outputs(two_ranks, qwen05_path, "draft", "--draft-model", str(qwen05_path),
                          "--num-speculative-tokens", "4")
    assert draft == none
    from conftest import LiveServer

    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    single = LiveServer(qwen05_path, spec=SpecDecodeConfig(mode="none"))
    try:
        alone = _parallel(lambda p: httpx.post(single.url + "/v1/chat/completions", timeout=300,
                                               json={"model": single.model, "max_tokens": 40,
                                                     "temperature": 0, "messages": [
                                                         {"role": "user", "content": p}]}
                                               ).json()["choices"][0]["message"]["content"],
                          QWEN_PROMPTS)
    finally:
        single.close()
    same = sum(a == b for a, b in zip(alone, none))
    print(f"\ntwo ranks vs one process: {same} of {len(none)} greedy outputs identical")


def test_a_killed_rank_ends_streams_with_an_error_and_every_rank_exits(two_ranks,
                                                                      tiny_qwen3_path):
    tp = two_ranks(tiny_qwen3_path, "--spec-decode", "ngram", name="kill")
    events = []
    with httpx.stream("POST", tp.url + "/v1/completions", timeout=60, json={
            "model": tp.model, "prompt": "Once upon a time", "max_tokens": 100000,
            "temperature": 0, "stream": True, "logit_bias": {"2": -100, "0": -100}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                tp.procs[1].kill()
                killed_at = time.monotonic()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "error" in error and "tensor parallel stopped" in error["error"]["message"]
    status = tp.procs[0].wait(30)
    assert status == 1
    assert time.monotonic() - killed_at < 30
    assert "tensor parallel stopped" in tp.log(0)


def test_a_plan_that_cannot_be_shared_ends_streams_and_tells_the_server(smollm2):
    """Rank 0's inference loop failing under tensor parallel (here its plan
    cannot be shared): the loop stops, every open stream ends with a
    distributed_failure error, and the ``on_fatal`` handed to the scheduler
    at its construction hears the reason (the server then exits 1)."""
    import asyncio

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.serving.request import GenerationRequest

    class BrokenLink:
        size, rank, leader = 2, 0, True

        def share_plan(self, plan=None):
            raise ConnectionError("rank 1 is gone")

    heard = []
    model, tokenizer = smollm2
    s = make_scheduler(model, tokenizer, link=BrokenLink(), on_fatal=heard.append)

    async def run():
        handle = s.submit(GenerationRequest([1, 2, 3], 4))
        assert s.tick() is False
        return await asyncio.wait_for(handle.events.get(), 5)

    event = asyncio.run(run())
    assert event.code == "distributed_failure" and "rank 1 is gone" in event.message
    assert heard == ["ConnectionError: rank 1 is gone"] and s.failed == heard[0]
    s.batch.close()


def _launch(tmp_path: Path, model: Path) -> tuple:
    """``mlx.launch -n 2 --backend ring -- <venv>/bin/mlx-lm-server --model
    M`` in a session of its own, once rank 0 answers: (launcher, url, log)."""
    launch = Path(sys.executable).parent / "mlx.launch"
    server = Path(sys.executable).parent / "mlx-lm-server"
    (port,) = free_ports(1)
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(launch), "-n", "2", "--backend", "ring", "--",
                                 str(server), "--model", str(model),
                                 "--port", str(port), "--spec-decode", "ngram"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if time.monotonic() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(log.read_text())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            time.sleep(0.2)


def test_mlx_launch_as_the_readme_says(tmp_path, tiny_qwen3_path):
    """``mlx.launch -n 2 --backend ring -- <venv>/bin/mlx-lm-server --model M``;
    SIGTERM to rank 0 stops both ranks, and mlx.launch exits 0."""
    proc, url, log = _launch(tmp_path, tiny_qwen3_path)
    try:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": tiny_qwen3_path.name, "prompt": "Hello", "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(url + "/health").json()["tensor_parallel"]["ranks"] == 2
        rank0 = _rank_pid(proc.pid, 0)
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(60) == 0
        text = log.read_text()
        sums = re.findall(r"stopped .* after plan \d+: checksum ([0-9a-f]{8})", text)
        assert len(sums) == 2 and sums[0] == sums[1], text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_ranks_stop_when_mlx_launch_is_killed(tmp_path, tiny_qwen3_path, sig):
    """``mlx.launch`` forwards no signal when it is killed itself: its ranks
    see their parent gone and stop as on SIGTERM, every process gone within
    10 s. At rest after a request (SIGTERM: rank 1 asleep until rank 0's stop
    plan) and with a stream open (SIGKILL: it ends with an error event and
    [DONE])."""
    proc, url, log = _launch(tmp_path, tiny_qwen3_path)
    try:
        ranks = [_rank_pid(proc.pid, r) for r in (0, 1)]
        if sig == signal.SIGTERM:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": tiny_qwen3_path.name, "prompt": "Hello", "max_tokens": 8})
            assert r.status_code == 200
            time.sleep(1.5)  # rank 0 shares its idle plan; rank 1 goes to sleep
            proc.send_signal(sig)
            killed_at = time.monotonic()
        else:
            events = []
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": tiny_qwen3_path.name, "prompt": "Once upon a time",
                    "max_tokens": 100000, "temperature": 0, "stream": True,
                    "logit_bias": {"2": -100, "0": -100}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            proc.send_signal(sig)
                            killed_at = time.monotonic()
            assert events[-1] == "[DONE]"
            assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-2]
        proc.wait(10)
        while any(map(_running, ranks)) and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
        assert not any(map(_running, ranks)), log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's new parent may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_ranks_sleep_and_the_next_request_wakes_them(two_ranks, tiny_qwen3_path):
    """After a request, 5 idle seconds cost each rank under 5% of a core (a
    follower waiting inside the collective spins a whole one) and share no
    plan; the next request is answered as promptly as one sent while the
    ranks were awake. Rank 0 killed while rank 1 sleeps: rank 1 exits at once."""
    tp = two_ranks(tiny_qwen3_path, "--spec-decode", "ngram", name="idle")
    body = {"max_tokens": 8, "temperature": 0}
    want = tp.complete("Hello", **body)["choices"][0]["text"]
    tic = time.monotonic()
    assert tp.complete("Hello", **body)["choices"][0]["text"] == want
    awake = time.monotonic() - tic
    time.sleep(1.5)  # rank 0 shares one idle plan 0.5 s after its last command
    plans = tp.health()["tensor_parallel"]["plans"]
    before = [_cpu_seconds(p.pid) for p in tp.procs]
    tic = time.monotonic()
    time.sleep(5)
    used = [(_cpu_seconds(p.pid) - b) / (time.monotonic() - tic)
            for p, b in zip(tp.procs, before)]
    assert max(used) < 0.05, f"idle CPU per rank {used}"
    assert tp.health()["tensor_parallel"]["plans"] == plans
    tic = time.monotonic()
    assert tp.complete("Hello", **body)["choices"][0]["text"] == want
    assert time.monotonic() - tic < awake + 5

    time.sleep(1.5)
    tp.procs[0].kill()
    assert tp.procs[1].wait(5) == 1
    assert "rank 0 closed its connection" in tp.log(1)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank``'s server among the launcher's descendants."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env and b"mlx-lm-server" in cmd \
                and os.getsid(int(pid)) == launcher:
            return int(pid)
    raise AssertionError(f"no rank {rank} under the launcher {launcher}")


def test_a_rank_that_stops_answering_ends_every_process(two_ranks, tiny_qwen3_path):
    """Rank 1 frozen (SIGSTOP) mid-stream: rank 0's watchdog ends the stream
    with an error and exits 1 within the timeout; rank 1, thawed, finds rank
    0 gone and exits 1 too."""
    tp = two_ranks(tiny_qwen3_path, "--spec-decode", "ngram", "--distributed-timeout", "4",
                   name="hang")
    events = []
    with httpx.stream("POST", tp.url + "/v1/completions", timeout=60, json={
            "model": tp.model, "prompt": "Once upon a time", "max_tokens": 100000,
            "temperature": 0, "stream": True, "logit_bias": {"2": -100, "0": -100}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                tp.procs[1].send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
    assert events[-1] == "[DONE]"
    assert "no heartbeat" in json.loads(events[-2])["error"]["message"]
    assert tp.procs[0].wait(30) == 1
    assert time.monotonic() - frozen_at < 20
    tp.procs[1].send_signal(signal.SIGCONT)
    assert tp.procs[1].wait(30) == 1


def test_a_peer_that_dies_with_beats_unread_counts_as_closed():
    """A rank killed with heartbeat bytes still unread in its socket resets
    the connection (RST, not FIN): the survivor reports the peer closed, not
    an unexplained socket error."""
    from types import SimpleNamespace

    from mlx_lm_server.parallel.liveness import Heartbeat

    lost = []
    link = SimpleNamespace(rank=1, plans=3, closing=False)
    heartbeat = Heartbeat(link, timeout=30, on_lost=lost.append)
    server = socket.create_server(("127.0.0.1", 0))
    conn = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    heartbeat._pump(conn, "rank 0")
    time.sleep(0.2)  # a beat arrives and stays unread
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()
    server.close()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost == ["rank 1: rank 0 closed its connection (reset) after plan 3"]


def test_the_launch_wrapper_stays_quiet_where_mlx_launch_spins(tmp_path):
    """mlx.launch's relay threads spin on the ranks' always-writable stdin
    pipes (and its main loop on a stdin at end of file); mlx-lm-server-launch
    runs the same launcher reading only: the ranks' output still arrives, at
    a small fraction of the CPU time, over the same 3 s of idle ranks."""
    import resource

    rank = [sys.executable, "-c", "import time; print('rank up', flush=True); time.sleep(3)"]
    launchers = {"mlx.launch": [str(Path(sys.executable).with_name("mlx.launch"))],
                 "ours": [sys.executable, "-m", "mlx_lm_server.parallel.launch"]}
    cpu = {}
    for name, launcher in launchers.items():
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([*launcher, "-n", "2", "--backend", "ring", "--", *rank],
                             cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert out.returncode == 0 and out.stdout.count("rank up") == 2, out.stdout + out.stderr
        cpu[name] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu["ours"] < 0.25 * cpu["mlx.launch"], cpu
