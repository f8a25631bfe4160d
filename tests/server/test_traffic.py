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


def _wait_for(recorder, records: int) -> None:
    deadline = time.monotonic() + 10
    while recorder.records < records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.records == records


def test_the_file_being_written_is_never_pruned(tmp_path):
    """A record larger than the whole bound: its file alone exceeds it, and
    it stays until it is closed (the next record opens a new file and
    prunes it)."""
    recorder = TrafficRecorder(str(tmp_path), max_bytes=500, file_bytes=200)
    recorder.record(list(range(300)), [1], "length")
    _wait_for(recorder, 1)
    assert [r["output_ids"] for r in _records(tmp_path)] == [[1]]
    recorder.record([7], [2], "stop")
    recorder.close()
    assert [r["output_ids"] for r in _records(tmp_path)] == [[2]]


def test_recorders_sharing_a_folder_never_prune_each_others_files(tmp_path):
    """Each model of a set records into the same folder: two recorders
    started in the same second write files of their own, and one's pruning
    never deletes the file the other is writing."""
    first = TrafficRecorder(str(tmp_path), max_bytes=500, file_bytes=10_000)
    second = TrafficRecorder(str(tmp_path), max_bytes=500, file_bytes=10_000)
    first.record([1, 2, 3], [1], "stop")
    _wait_for(first, 1)
    second.record(list(range(300)), [2], "length")  # past the bound: the second prunes
    _wait_for(second, 1)
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert [[json.loads(line)["output_ids"] for line in p.read_text().splitlines()]
            for p in files] == [[[1]], [[2]]]
    first.record([4], [3], "stop")
    first.close()
    second.close()
    assert sorted(r["output_ids"] for r in _records(tmp_path)) == [[1], [2], [3]]


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
