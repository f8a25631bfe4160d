"""Draft-model speculation on real models: compatibility, acceptance, parity, distribution."""

import pytest
from test_spec_engine import (
    _assert_same_or_near_tie,
    _chat,
    _prompts,
    _run,
)

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.proposer.draft_model import check_tokenizers

GREEDY = SamplingParams(temperature=0)

# Short prompts keep the 1.5B target's prefill cheap on a CPU.
SHORT_QUESTIONS = [
    "Write a Python function that returns the square of a number.",
    "What does HTTP stand for?",
    "Write a haiku about compilers.",
    "Explain recursion in one sentence.",
    "Write a SQL query that counts rows in a table named users.",
    "List three sorting algorithms.",
    "What is the capital of Japan?",
    "Write a bash command that counts lines in a file.",
]


def _scheduler(model, tokenizer, model_path, draft_path, mode="draft", **kw):
    spec = SpecDecodeConfig(mode=mode, draft_model_path=str(draft_path), **kw)
    s = make_scheduler(model, tokenizer, max_queued_requests=1000,
                  engine=make_engine(model, spec, tokenizer, str(model_path)))
    s.start()
    return s


def _stop(*schedulers):
    for s in schedulers:
        s.shutdown()
        s.join(10)


def test_incompatible_tokenizer_is_refused(smollm2, qwen05, smollm2_path, qwen05_path):
    with pytest.raises(ValueError, match="cannot draft for") as e:
        check_tokenizers(qwen05[1], smollm2[1], str(qwen05_path), str(smollm2_path))
    assert str(qwen05_path) in str(e.value) and str(smollm2_path) in str(e.value)
    assert "vocabulary sizes differ" in str(e.value)
    check_tokenizers(smollm2[1], smollm2[1], "a", "b")  # the same tokenizer is fine


def test_a_draft_whose_end_of_sequence_ids_differ_may_draft(smollm2_path, smollm2):
    """Qwen2.5 lists [151645] as end-of-sequence and Qwen3.5 [151643, 151645]
    over one vocabulary: the target's own ids end generation, so the draft's
    set does not matter. Here: SmolLM2's tokenizer with an extra end id."""
    from mlx_lm.utils import load_tokenizer

    draft_tok = load_tokenizer(smollm2_path)
    draft_tok.eos_token_ids = set(smollm2[1].eos_token_ids) | {1}
    assert draft_tok.eos_token_ids != smollm2[1].eos_token_ids
    check_tokenizers(smollm2[1], draft_tok, "target", "draft")


def test_cli_refuses_an_incompatible_draft(smollm2_path, qwen05_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.server", "--model", str(qwen05_path),
         "--spec-decode", "draft", "--draft-model-path", str(smollm2_path), "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0 and "cannot draft for" in out.stderr


def test_smollm2_as_its_own_draft_accepts_nearly_everything(smollm2, smollm2_path):
    """Same weights, so every greedy draft should match, up to float near-ties."""
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, smollm2_path, smollm2_path, num_speculative_tokens=4,
                   dynamic=False, adaptive_k=False)
    try:
        reqs = [GenerationRequest(p, 48, GREEDY) for p in _prompts(tokenizer)]
        _run(s, reqs, stagger=0.1)
        st = s.spec_stats.tokens
        assert st.num_draft_tokens > 200
        assert st.num_accepted_tokens / st.num_draft_tokens >= 0.98, st
    finally:
        _stop(s)


def test_a_sequence_past_the_drafts_context_is_decoded_plainly(smollm2, smollm2_path):
    """A prompt the target takes but the draft cannot (its context is shorter):
    that row is drafted for no more and leaves the draft cache, the others
    keep drafting while rows of different lengths join and leave (staggered),
    and every greedy output equals plain decoding."""
    model, tokenizer = smollm2
    prompts = _prompts(tokenizer)
    lengths = sorted(len(p) for p in prompts)
    plain = make_scheduler(model, tokenizer)
    plain.start()
    spec = _scheduler(model, tokenizer, smollm2_path, smollm2_path, num_speculative_tokens=4,
                      dynamic=False, adaptive_k=False)
    proposer = spec.engine.proposer.model  # the draft model's, a source of the per-row proposer
    assert proposer.max_context == 8192  # read from the draft's config.json
    proposer.max_context = lengths[len(lengths) // 2] + 8  # half the prompts outgrow it
    held = []  # the longest context the draft cache held after each proposal
    propose = proposer.propose

    def watched(*args, **kw):
        result = propose(*args, **kw)
        held.append(max((proposer.fed[u] for u in proposer.uids), default=0))
        return result

    proposer.propose = watched
    try:
        reqs = [GenerationRequest(p, 12 + 9 * (i % 4), GREEDY) for i, p in enumerate(prompts)]
        reqs.append(GenerationRequest(prompts[0], 24, SamplingParams(temperature=1.0, seed=7)))
        base = _run(plain, reqs[:-1], stagger=0.3)
        ours = _run(spec, reqs, stagger=0.3)
        for p, (a, _, da), (b, _, db) in zip(prompts, base, ours):
            _assert_same_or_near_tie(model, p, a, b)
            assert da.completion_tokens == len(a) and db.completion_tokens == len(b)
        assert len(ours[-1][0]) == 24
        assert spec.engine.steps.verify_steps > 0 and spec.spec_stats.tokens.num_draft_tokens > 0
        assert 0 < max(held) <= proposer.max_context
        assert proposer.cache is None and proposer.uids == []
    finally:
        _stop(plain, spec)


# Sampled drafts against the exact target distribution: with the draft's q
# and prompt lookup's one-hot q in the same passes, in test_mixed_proposer.py.


@pytest.fixture(scope="module")
def qwen15(qwen15_path):
    from mlx_lm import load

    return load(str(qwen15_path))


# One batch of 8 with staggered arrivals: parity, joins and leaves at once
# (a batch of one adds nothing the smaller pair tests do not cover).
@pytest.mark.slow  # long by nature: a 1.5B target on the CPU; the mixed and SmolLM2 pairs cover the path
@pytest.mark.parametrize("batch,stagger", [(8, 0.5)])
def test_qwen_pair_greedy_parity(qwen15, qwen15_path, qwen05_path, batch, stagger):
    """Qwen2.5-Coder-0.5B drafting for 1.5B gives the 1.5B's own greedy tokens."""
    model, tokenizer = qwen15
    plain = make_scheduler(model, tokenizer)
    plain.start()
    spec = _scheduler(model, tokenizer, qwen15_path, qwen05_path, num_speculative_tokens=4)
    try:
        prompts = [_chat(tokenizer, q) for q in SHORT_QUESTIONS[:batch]]
        reqs = [GenerationRequest(p, 24, GREEDY) for p in prompts]
        base = _run(plain, reqs, stagger)
        ours = _run(spec, reqs, stagger)
        for p, (a, _, _), (b, _, _) in zip(prompts, base, ours):
            _assert_same_or_near_tie(model, p, a, b)
        assert spec.spec_stats.tokens.num_accepted_tokens > 0
    finally:
        _stop(plain, spec)
