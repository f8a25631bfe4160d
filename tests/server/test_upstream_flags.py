"""mlx_lm.server's command line, accepted by ours with the same meaning.

One test reads upstream's own parser, so that a flag added upstream is
noticed on upgrade; the others show each flag's effect on the config, the
loaded model and tokenizer, the prepared request, and the HTTP app.
"""

import argparse
import json
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_lm_server.assembly import load_service
from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.config import SamplingDefaults, ServerConfig
from mlx_lm_server.http.openai_schema import ChatCompletionRequest
from mlx_lm_server.http.service import Service
from mlx_lm_server.models.source import CHATML_TEMPLATE, chat_template_text
from mlx_lm_server.server import resolve_sources


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@pytest.fixture(scope="module")
def upstream_parser(monkeypatch_module) -> argparse.ArgumentParser:
    """mlx_lm.server's parser, as its ``main`` builds it (stopped at parse_args)."""
    import mlx_lm.server

    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch_module.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed) as parsed:
        mlx_lm.server.main()
    monkeypatch_module.undo()
    return parsed.value.parser


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def test_every_upstream_flag_is_accepted(upstream_parser):
    ours = _options(build_parser())
    theirs = _options(upstream_parser)
    assert len(theirs) >= 20  # the parser was found, not an empty one
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"mlx_lm.server flags that ours refuses: {missing}"
    # A switch upstream is a switch here, and a flag with a value takes one.
    for flag, action in theirs.items():
        assert (action.nargs == 0) == (ours[flag].nargs == 0), flag


def _upstream_command_line(model: str, adapter: str) -> list[str]:
    return [
        "--model", model, "--adapter-path", adapter, "--host", "0.0.0.0", "--port", "9001",
        "--allowed-origins", "https://a.example,http://localhost:3000",
        "--draft-model", model, "--num-draft-tokens", "5", "--trust-remote-code",
        "--log-level", "WARNING", "--chat-template", "{{ messages[0]['content'] }}",
        "--use-default-chat-template", "--temp", "0.7", "--top-p", "0.9", "--top-k", "40",
        "--min-p", "0.05", "--max-tokens", "100",
        "--chat-template-args", '{"enable_thinking": false}',
        "--decode-concurrency", "12", "--prompt-concurrency", "3",
        "--prefill-step-size", "256", "--prompt-cache-size", "4",
        "--prompt-cache-bytes", "1000000", "--kv-group-size", "32",
        "--kv-bits", "8", "--quantized-kv-start", "100", "--pipeline",
    ]


def test_an_upstream_command_line_means_the_same_here(upstream_parser):
    argv = _upstream_command_line("models/m", "adapters")
    assert set(_options(upstream_parser)) <= set(argv)  # every flag used
    up = upstream_parser.parse_args(argv)
    c = config_from_args(build_parser().parse_args(argv), environ={})
    assert (c.model, c.adapter_path, c.host, c.port) == (up.model, up.adapter_path, up.host,
                                                         up.port)
    assert list(c.allowed_origins) == up.allowed_origins
    # Upstream drafts with the draft model; auto tells the folder apart (a draft
    # model: "ngram,draft", each row drafted by whichever keeps more).
    assert (c.spec.mode, c.spec.draft_model_path) == ("auto", up.draft_model)
    assert c.spec.num_speculative_tokens == up.num_draft_tokens
    assert c.trust_remote_code is up.trust_remote_code is True
    assert c.log_level == up.log_level.lower()
    assert c.chat_template == up.chat_template
    assert c.use_default_chat_template is up.use_default_chat_template is True
    assert c.sampling_defaults == SamplingDefaults(up.temp, up.top_p, up.top_k, up.min_p)
    assert c.max_tokens == up.max_tokens
    assert c.chat_template_args == up.chat_template_args
    # The aliases: upstream's concurrency flags are our batch sizes.
    assert c.max_batch_size == up.decode_concurrency == 12
    assert c.prefill_batch_size == up.prompt_concurrency == 3
    assert (c.prefill_step_size, c.prompt_cache_size, c.prompt_cache_bytes) == (
        up.prefill_step_size, up.prompt_cache_size, up.prompt_cache_bytes)
    assert (c.kv_bits, c.kv_group_size, c.quantized_kv_start) == (
        up.kv_bits, up.kv_group_size, up.quantized_kv_start)
    assert c.pipeline is up.pipeline is True


def test_defaults_left_alone_keep_ours():
    c = config_from_args(build_parser().parse_args(["--model", "m"]), environ={})
    assert c.sampling_defaults.given() == {}
    assert c.allowed_origins == ("*",)  # upstream's default
    assert (c.adapter_path, c.chat_template, c.chat_template_args) == (None, None, {})
    assert c.spec.mode == "auto"  # ours: speculation on by default
    c = config_from_args(build_parser().parse_args(["--model", "m", "--allowed-origins", ""]),
                         environ={})
    assert c.allowed_origins == ()


@pytest.mark.parametrize("argv, message", [
    (["--chat-template-args", "[1]"], "must be a JSON object"),
    (["--chat-template-args", '{"tools": []}'], "cannot set tools"),
    (["--temp", "-1"], "--temp must be between"),
    (["--top-p", "0"], "--top-p must be above 0"),
    (["--top-k", "-2"], "--top-k must be 0"),
    (["--kv-group-size", "48"], "--kv-group-size must be one of"),
    (["--kv-bits", "7"], "--kv-bits must be one of"),
])
def test_bad_values_are_refused(argv, message, capsys):
    try:
        config_from_args(build_parser().parse_args(["--model", "m", *argv]), environ={})
    except SystemExit:  # argparse's own refusal
        assert message in capsys.readouterr().err
    except ValueError as e:
        assert message in str(e)
    else:
        pytest.fail(f"{argv} accepted")


def test_chat_template_and_adapter_path_are_checked_before_loading(smollm2_path, tmp_path):
    base = ServerConfig(model=str(smollm2_path))
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        resolve_sources(replace(base, chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(ValueError, match="adapter_config.json"):
        resolve_sources(replace(base, adapter_path=str(tmp_path)))
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}!")
    resolved = resolve_sources(replace(base, chat_template=str(tmp_path / "t.jinja")))
    assert resolved.chat_template == "{{ messages[0]['content'] }}!"
    assert chat_template_text("{{ x }}") == "{{ x }}"


# --- the sampling defaults, on the prepared request ---------------------------------

def _chat(model="m", **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "hi"}],
                                 **fields)


def _sampled(service, **fields) -> tuple:
    s = service._sampling(_chat(**fields))
    return (s.temperature, s.top_p, s.top_k, s.min_p)


def test_sampling_defaults_apply_only_where_the_request_omits_the_field(smollm2):
    _, tokenizer = smollm2
    plain = Service(ServerConfig(model="m"), tokenizer, None, None)
    assert _sampled(plain) == (1.0, 1.0, 0, 0.0)  # the API's defaults
    server_wide = SamplingDefaults(temperature=0.3, top_p=0.5, top_k=7, min_p=0.1)
    service = Service(ServerConfig(model="m", sampling_defaults=server_wide), tokenizer,
                      None, None)
    assert _sampled(service) == (0.3, 0.5, 7, 0.1)
    # A field sent with the API's default value is still the request's own.
    assert _sampled(service, temperature=1.0) == (1.0, 0.5, 7, 0.1)
    assert _sampled(service, top_p=1.0, min_p=0.0) == (0.3, 1.0, 7, 0.0)
    assert _sampled(service, top_k=0) == (0.3, 0.5, 0, 0.1)
    # Only some given on the command line: the rest keep the API's defaults.
    some = Service(ServerConfig(model="m", sampling_defaults=SamplingDefaults(temperature=0.0)),
                   tokenizer, None, None)
    assert _sampled(some) == (0.0, 1.0, 0, 0.0)


# --- one loaded service: adapter, template file, template args ----------------------

TEMPLATE = ("{{ greeting }} {{ mood }}|{% for m in messages %}{{ m['role'] }}:"
            "{{ m['content'] }};{% endfor %}")


def _write_adapter(folder, model_path) -> None:
    """A LoRA adapter for the last two layers, random and nonzero (a fresh
    one's lora_b is zero, which would change nothing)."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_path))
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(0)
    weights = {name: 0.05 * mx.random.normal(w.shape)
               for name, w in tree_flatten(model.parameters())
               if name.endswith((".lora_a", ".lora_b"))}
    assert weights
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))


@pytest.fixture(scope="module")
def adapted(smollm2_path, tmp_path_factory):
    """A service as `--adapter-path A --chat-template FILE --chat-template-args
    JSON` loads it."""
    tmp = tmp_path_factory.mktemp("upstream-flags")
    _write_adapter(tmp / "adapter", smollm2_path)
    (tmp / "template.jinja").write_text(TEMPLATE)
    argv = ["--model", str(smollm2_path), "--adapter-path", str(tmp / "adapter"),
            "--chat-template", str(tmp / "template.jinja"),
            "--chat-template-args", '{"greeting": "hello", "mood": "calm"}']
    return load_service(resolve_sources(config_from_args(build_parser().parse_args(argv),
                                                         environ={})))


def _prompt_text(service, **fields) -> str:
    request, _ = service.prepare(_chat(model=service.config.model_id, **fields))
    return service.tokenizer.decode(request.prompt_tokens)


def test_the_adapter_changes_the_logits(adapted, smollm2):
    base, tokenizer = smollm2
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    served = adapted.scheduler.batch.model(tokens)
    plain = base(tokens)
    assert served.shape == plain.shape
    assert mx.abs(served - plain).max().item() > 1.0


def test_the_chat_template_file_is_used(adapted):
    assert _prompt_text(adapted) == "hello calm|user:hi;"


def test_a_requests_template_kwargs_override_the_defaults_key_by_key(adapted):
    assert _prompt_text(adapted, chat_template_kwargs={"greeting": "bye"}) == "bye calm|user:hi;"


def test_use_default_chat_template_gives_chatml_to_a_model_without_one(smollm2_path, tmp_path):
    folder = tmp_path / "no-template"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to((smollm2_path / name).resolve())
    tokenizer_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    service = load_service(ServerConfig(model=str(folder), use_default_chat_template=True))
    assert service.tokenizer.chat_template == CHATML_TEMPLATE
    assert _prompt_text(service) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- CORS ---------------------------------------------------------------------------

def _client(service, **config):
    from fastapi.testclient import TestClient

    from mlx_lm_server.http.routes import create_app

    changed = Service(replace(service.config, **config), service.tokenizer, service.scheduler,
                      service.max_context, grammar_tokenizer=service.grammar_tokenizer,
                      budget=service.budget, metrics=service.metrics)
    return TestClient(create_app(changed))


def _preflight(client, origin: str):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_any_origin_by_default(adapted):
    client = _client(adapted)
    r = _preflight(client, "https://a.example")
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = client.get("/v1/models", headers={"Origin": "https://a.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cors_listed_origins_only(adapted):
    client = _client(adapted, allowed_origins=("https://a.example",))
    r = _preflight(client, "https://a.example")
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://a.example"
    assert "origin" in r.headers["vary"].lower()
    r = _preflight(client, "https://b.example")
    assert "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"Origin": "https://b.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_off_with_no_origins(adapted):
    r = _client(adapted, allowed_origins=()).get("/v1/models",
                                                 headers={"Origin": "https://a.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_preflight_needs_no_key_and_a_401_carries_cors(adapted):
    client = _client(adapted, api_key="secret")
    r = _preflight(client, "https://a.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = client.get("/v1/models", headers={"Origin": "https://a.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
