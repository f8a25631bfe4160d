"""``--record-traffic DIR``: finished requests' token ids on disk, bounded,
read back by the drafter trainer as its data."""

import json
import time

import httpx

from mlx_lm_server.drafter.data import read_sequences
from mlx_lm_server.serving.traffic import TrafficRecorder


def _records(folder):
    return [json.loads(line) for path in sorted(folder.glob("traffic-*.jsonl"))
            for line in path.read_text().splitlines()]


def test_the_record_rotates_and_keeps_the_newest_within_its_bound(tmp_path):
    recorder = TrafficRecorder(str(tmp_path), max_bytes=3000, file_bytes=1000)
    for i in range(60):
        recorder.record(list(range(i, i + 10)), [i] * 5, "length")
    recorder.close()
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert sum(p.stat().st_size for p in files) <= 3000
    assert 2 <= len(files) <= 4, files
    kept = [r["output_ids"][0] for r in _records(tmp_path)]
    assert kept == list(range(60 - len(kept), 60)), kept  # the newest, in order
    assert recorder.records == 60


def test_the_server_records_what_it_served_and_the_trainer_reads_it(make_server, tmp_path):
    folder = tmp_path / "traffic"
    server = make_server(record_traffic=str(folder))
    answers = []
    for prompt in ("def add(a, b):", "The capital of France is"):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        answers.append(r.json())
    deadline = time.monotonic() + 10
    while server.scheduler.recorder.records < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    records = _records(folder)
    assert len(records) == 2
    for record, answer in zip(records, answers):
        assert len(record["prompt_ids"]) == answer["usage"]["prompt_tokens"]
        assert len(record["output_ids"]) == answer["usage"]["completion_tokens"]
        assert server.tokenizer.decode(record["output_ids"]) == answer["choices"][0]["text"]
        assert record["finish_reason"] == answer["choices"][0]["finish_reason"]
    assert server.tokenizer.decode(records[0]["prompt_ids"]).endswith("def add(a, b):")

    sequences = read_sequences(server.tokenizer, sorted(folder.glob("*.jsonl")), max_len=512)
    assert sequences == [r["prompt_ids"] + r["output_ids"] for r in records]
