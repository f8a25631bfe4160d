"""The converted folders behave like the original models: tokenizer and text."""

import functools
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODELS = ["smollm2_path", "qwen05_path"]
LOADED = ["smollm2", "qwen05"]

ROUND_TRIP = [
    "def add(a, b):\n    return a + b\n",
    "class Foo(Bar):\n\tdef __init__(self):\n\t\tself.x = {'k': [1, 2, 3]}\n",
    "The quick brown fox jumps over the lazy dog. It's 12:45, isn't it?",
    "naïve café résumé — “quotes” ‘single’ … ©®™",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🦀🐍👩‍💻 and flags 🇫🇷",
    "   leading spaces, trailing spaces   ",
    "\n\n\nmany\n\n\n\nnewlines\r\nand CRLF\r\n",
    "tabs\t\tand  double  spaces\u00a0nbsp",
    "",
    " ",
    "1234567890 3.14159 -42 1e-5 0x1F",
    "<|im_start|> looks special but is typed by a user",
    "SELECT * FROM users WHERE id = 1;  -- sql",
]


@functools.lru_cache(maxsize=None)
def _tokenizer(folder):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(folder)


@pytest.fixture(scope="module", params=MODELS)
def tokenizer(request):
    return _tokenizer(request.getfixturevalue(request.param))


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


# SmolLM2's own vocabulary lacks 21 of the 256 byte symbols (lead bytes of
# planes 4-16 and some C0 controls), so text using them cannot round-trip in
# the original tokenizer either.
_TEXT = st.text(
    alphabet=st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs", "Cc"))
    | st.sampled_from("\n\t\r "),
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_round_trip_property(smollm2_path, text):
    tok = _tokenizer(smollm2_path)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_digits_split_individually(tokenizer):
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("x=12345", add_special_tokens=False)]
    assert pieces[-5:] == ["1", "2", "3", "4", "5"]


def test_qwen2_pretokenizer_keeps_newline_runs(qwen05_path):
    """Qwen2's regex merges punctuation with following newlines; GPT-2's does not."""
    tok = _tokenizer(qwen05_path)
    pieces = [tok.decode([i]) for i in tok.encode("f():\n\n    pass", add_special_tokens=False)]
    assert "():\n\n" in pieces


def test_special_tokens_are_single_ids(tokenizer):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == im_start
    assert tokenizer.eos_token_id in tokenizer.eos_token_ids


def test_no_bos_added(tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=True)
    assert ids == tokenizer.encode("hello", add_special_tokens=False)


def test_chat_template_renders(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def _greedy(model, tokenizer, prompt, max_tokens):
    from mlx_lm import generate

    return generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)


@pytest.mark.parametrize("fixture", LOADED)
def test_capital_of_france(request, fixture):
    model, tokenizer = request.getfixturevalue(fixture)
    assert "Paris" in _greedy(model, tokenizer, "The capital of France is", 8)


def test_qwen_writes_code(qwen05):
    model, tokenizer = qwen05
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function add(a, b) that returns their sum."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    text = _greedy(model, tokenizer, prompt, 64)
    assert "def add(a, b):" in text and "return a + b" in text


@pytest.mark.parametrize("fixture", LOADED)
def test_model_output_is_canonically_tokenized(request, fixture):
    """Re-encoding the model's own greedy text gives back its tokens.

    Prompt lookup only matches if a prompt is tokenized the way the model emits
    the same text; a wrong pre-tokenizer breaks this.
    """
    from mlx_lm import stream_generate

    model, tokenizer = request.getfixturevalue(fixture)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short Python function that reverses a list, with a docstring."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=48)]
    ids = [t for t in ids if t not in tokenizer.eos_token_ids]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


@pytest.mark.slow
def test_qwen15_capital_of_france(qwen15_path):
    from mlx_lm import load

    model, tokenizer = load(str(qwen15_path))
    assert "Paris" in _greedy(model, tokenizer, "The capital of France is", 8)


def test_tiny_qwen3_loads_and_generates(tiny_qwen3_path):
    """The random qwen3 folder opens with upstream `load` and runs qwen3's code."""
    from mlx_lm import load, stream_generate
    from mlx_lm.models import qwen3

    model, tokenizer = load(str(tiny_qwen3_path))
    assert isinstance(model, qwen3.Model)
    assert model.layers[0].self_attn.q_norm is not None
    out = list(stream_generate(model, tokenizer, "hello", max_tokens=5))
    assert len(out) == 5
