"""Pipeline parallel (``--pipeline``) over two ranks on loopback.

The same plans, lock-step checks and liveness as tensor parallel
(``test_tensor_parallel.py``, whose launcher this reuses); only the split
differs: each rank holds consecutive layers. The hidden state passes from
rank to rank exactly and every rank takes the last stage's output, so greedy
text equals one process's, token for token.
"""

import httpx
import pytest
from conftest import LiveServer
from test_tensor_parallel import CODE, _final_checksums, two_ranks  # noqa: F401

from mlx_lm_server.parallel.distributed import load_pipelined
from mlx_lm_server.spec_decode.config import SpecDecodeConfig

PROMPT = "# Rename f3 to g3 and return the whole code.\n{}\n# Renamed:\n".format(
    CODE[: CODE.index("def f5")])
BODY = {"max_tokens": 20, "temperature": 0}


def test_a_model_class_without_a_pipeline_split_is_refused_naming_it(smollm2_path):
    """SmolLM2 is llama, which has no ``pipeline`` in mlx-lm: refused before
    any weight is read (the server prints it and exits 2, as for a model
    tensor parallel cannot split)."""

    class TwoRanksGroup:  # what the refusal reads of the group
        def size(self):
            return 2

        def rank(self):
            return 0

    with pytest.raises(ValueError, match=r"smollm2-135m-instruct: mlx-lm's "
                                         r"mlx_lm\.models\.llama has no pipeline split"):
        load_pipelined(str(smollm2_path), TwoRanksGroup())


def test_two_stage_pipeline_gives_the_text_of_one_process(two_ranks, qwen05_path):  # noqa: F811
    """Qwen2.5-Coder-0.5B (qwen2: 24 layers, 12 per rank), one launch: a
    plain request and an n-gram speculative one (the request's
    ``spec_decode``) both give one process's greedy text; the ranks end with
    equal checksums; rank 0 holds about half the layers' memory."""
    single = LiveServer(qwen05_path, spec=SpecDecodeConfig(mode="none"))
    try:
        want = _complete(single.url, single.model, spec_decode=False)
        whole = httpx.get(single.url + "/health", timeout=5).json()["memory"]["active"]
    finally:
        single.close()

    # Speculation on whenever asked (no controller, no calibration: fewer passes).
    pp = two_ranks(qwen05_path, "--pipeline", "--spec-decode", "ngram", "--no-spec-decode-dynamic",
                   "--spec-calibration-seconds", "0", name="pipeline")
    health = pp.health()
    assert health["tensor_parallel"]["split"] == "pipeline"
    plain = _complete(pp.url, pp.model, spec_decode=False)
    spec = _complete(pp.url, pp.model, spec_decode=True)
    assert plain["text"] == want["text"]
    assert spec["text"] == want["text"]
    assert plain["usage"]["spec_decode"]["draft_tokens"] == 0
    assert spec["usage"]["spec_decode"]["accepted_tokens"] > 0, spec["usage"]
    # Rank 0 holds the embeddings and 12 of 24 layers (about 0.7 of 2.0 GB
    # fewer than one process); every rank loading the whole model would not.
    assert health["memory"]["active"] < whole - 0.4e9, (health["memory"], whole)
    assert pp.stop() == [0, 0]
    a, b = _final_checksums(pp)
    assert a == b
    assert "rank 1 holds layers 0-11 of 24" in pp.log(1)


def _complete(url: str, model: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"model": model, "prompt": PROMPT, **BODY, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], "usage": out["usage"]}
