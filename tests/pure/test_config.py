"""Configuration is validated in one place: each rule, case by case, and the CLI
that feeds it."""

import json
import re
from pathlib import Path

import pytest

from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.config import ServerConfig
from mlx_lm_server.spec_decode.auto import drafter_kind
from mlx_lm_server.spec_decode.config import MODES, VERIFY_MODES, SpecDecodeConfig
from mlx_lm_server.spec_decode.proposer import PROPOSERS, TEXT, make_proposer


@pytest.mark.parametrize("kw, message", [
    (dict(mode="eagle"), "--spec-decode must be one of"),
    (dict(mode="ngram", verify_mode="fast"), "--spec-verify must be one of"),
    (dict(mode="ngram", num_speculative_tokens=0), "between 1 and 64"),
    (dict(mode="ngram", num_speculative_tokens=65), "between 1 and 64"),
    (dict(mode="ngram", ngram_min=0), "1 <= --ngram-min <= --ngram-max"),
    (dict(mode="ngram", ngram_min=5, ngram_max=4), "1 <= --ngram-min <= --ngram-max"),
    (dict(mode="ngram", ngram_max=17), "at most 16"),
    (dict(mode="ngram", disable_by_batch_size=0), "at least 1"),
    (dict(mode="ngram", acceptance_threshold=1.5), "between 0 and 1"),
    (dict(mode="ngram", acceptance_threshold=-0.1), "between 0 and 1"),
    (dict(mode="ngram", ema_alpha=0.0), "(0, 1]"),
    (dict(mode="ngram", verify_threshold=0.0), "(0, 1]"),
    (dict(mode="ngram", calibration_seconds=-1), "between 0 and 600"),
    (dict(mode="ngram", tree_width=9), "--spec-tree-width must be between 1 and 8"),
    (dict(mode="ngram", tree_width=2, tree_budget=0), "--spec-tree-budget must be auto or"),
    (dict(mode="ngram", tree_width=2, tree_budget=65), "--spec-tree-budget must be auto or"),
    (dict(mode="ngram", tree_budget=8), "--spec-tree-budget needs --spec-tree-width above 1"),
    (dict(mode="draft"), "needs --draft-model"),
    (dict(mode="suffix,draft"), "suffix,draft needs --draft-model"),
    (dict(mode="draft,ngram", draft_model_path="x"), "--spec-decode must be one of"),
    (dict(mode="ngram", draft_model_path="x"), "only used with --spec-decode auto, draft"),
    (dict(mode="draft", draft_model_path="x", draft_model_quantize=3), "4 or 8"),
])
def test_spec_config_refuses(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SpecDecodeConfig(**kw)


@pytest.mark.parametrize("kw", [
    dict(), dict(mode="ngram", num_speculative_tokens=1), dict(mode="ngram", ngram_min=4),
    dict(mode="ngram", ngram_max=16, num_speculative_tokens=64, calibration_seconds=0),
    dict(mode="draft", draft_model_path="x", draft_model_quantize=4),
    dict(mode="ngram", acceptance_threshold=1.0, verify_threshold=1.0, ema_alpha=1.0),
    dict(mode="ngram", tree_width=8, tree_budget=64), dict(mode="ngram", tree_width=2, tree_budget=1),
])
def test_spec_config_accepts_the_boundaries(kw):
    SpecDecodeConfig(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(max_batch_size=0), "--max-batch-size"), (dict(prefill_batch_size=0), "--prefill-batch-size"),
    (dict(prefill_step_size=0), "--prefill-step-size"), (dict(max_tokens=0), "--max-tokens"),
    (dict(max_queued_requests=-1), "--max-queued-requests"), (dict(port=70000), "--port"),
    (dict(log_level="loud"), "--log-level"),
    (dict(api_key=""), "--api-key"), (dict(api_key="two words"), "--api-key"),
    (dict(api_key="clé"), "--api-key"),
])
def test_server_config_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(model="m", **kw)


def test_modes_follow_from_the_drafter_kinds():
    assert MODES[:2] == ("none", "auto")  # auto stands for one of the others
    assert {m for m in MODES if "," not in m} == {"none", "auto"} | set(PROPOSERS)
    # A mix is a kind that drafts from text, then one that runs a model.
    cheap = {n for n, kind in PROPOSERS.items() if kind.drafts_with == TEXT}
    models = set(PROPOSERS) - cheap
    assert cheap and models
    assert {m for m in MODES if "," in m} == {f"{c},{m}" for c in cheap for m in models}
    assert len(set(MODES)) == len(MODES)


def test_a_kind_needs_what_it_drafts_with():
    for name, kind in PROPOSERS.items():
        assert kind.folder or not kind.needs_folder, name  # the error names the folder
        assert kind.recognises is None or kind.folder, name  # auto recognises only folders
        if kind.needs_folder:
            with pytest.raises(ValueError, match=f"{name} needs --draft-model"):
                SpecDecodeConfig(mode=name)
        if kind.folder:
            SpecDecodeConfig(mode=name, draft_model_path="x")
        else:
            with pytest.raises(ValueError, match="only used with"):
                SpecDecodeConfig(mode=name, draft_model_path="x")
    assert SpecDecodeConfig(mode="suffix,mtp").uses_mtp
    assert SpecDecodeConfig(mode="ngram,eagle3", draft_model_path="x").uses_head
    assert SpecDecodeConfig(mode="draft", draft_model_path="x").uses_draft_model
    assert not SpecDecodeConfig(mode="suffix").uses_head


@pytest.mark.parametrize("mode", ["mtp", "ngram,eagle3"])
def test_a_kind_that_drafts_from_the_target_is_not_built_without_it(mode):
    with pytest.raises(ValueError, match="no target given"):
        make_proposer(SpecDecodeConfig(mode=mode, draft_model_path="x"))


@pytest.mark.parametrize("config, kind", [
    ({"speculators_model_type": "eagle3"}, "eagle3"), ({"dflash_config": {}}, "dflash"),
    ({"model_type": "qwen3_5_mtp"}, "mtp"), ({"model_type": "llama"}, "draft")])
def test_auto_takes_a_draft_folder_for_the_kind_that_recognises_it(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert drafter_kind(str(tmp_path)) == kind


def _readme_spec_decode_row() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    return next(line for line in readme.splitlines()
                if line.startswith("| `--spec-decode MODE`"))


def test_readme_the_cli_and_the_registry_list_the_same_modes():
    # README.md cannot be generated: this is what keeps it with the registry.
    listed, described = re.match(r"\| `--spec-decode MODE` \(([^)]*)\)(.*)",
                                 _readme_spec_decode_row()).groups()
    modes = ", ".join(f"`{mode}`" for mode in MODES)
    assert tuple(re.findall(r"`([^`]+)`", listed)) == MODES, f"README.md should list ({modes})"
    assert all(f"`{name}`" in described for name in PROPOSERS)  # each kind said what it is
    parser = build_parser()
    spec_decode = next(a for a in parser._actions if a.dest == "spec_decode")
    assert tuple(spec_decode.choices) == MODES
    assert tuple(next(a for a in parser._actions if a.dest == "spec_verify").choices) \
        == VERIFY_MODES
    for mode in MODES:  # a mode alone is described, "ngram (...)"; a mix is named
        ending = r"(?![\w]|,\w)" if "," in mode else r" \("
        assert re.search(rf"(?<![\w,]){re.escape(mode)}{ending}", spec_decode.help), mode


@pytest.mark.parametrize("flag", ["--draft-model", "--draft-model-path"])
@pytest.mark.parametrize("bits, expected", [("4", 4), ("8", 8), ("4bit", 4), ("8BIT", 8)])
def test_draft_model_flags(flag, bits, expected):
    args = build_parser().parse_args(["--model", "m", "--spec-decode", "draft", flag, "d",
                                      "--draft-model-quantize", bits])
    config = config_from_args(args)
    assert config.spec.draft_model_path == "d" and config.spec.draft_model_quantize == expected


@pytest.mark.parametrize("argv, expected", [([], None), (["--spec-tree-budget", "auto"], None),
                                             (["--spec-tree-budget", "24"], 24)])
def test_tree_budget_flag(argv, expected):
    args = build_parser().parse_args(["--model", "m", "--spec-tree-width", "3"] + argv)
    spec = config_from_args(args).spec
    assert spec.tree_budget == expected
    assert spec.most_drafts == max(spec.num_speculative_tokens, expected or 0)


def test_tree_budget_flag_refuses_what_is_not_a_number(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--spec-tree-budget", "many"])
    assert "--spec-tree-budget" in capsys.readouterr().err


@pytest.mark.parametrize("bits", ["3", "4bits", "sixteen"])
def test_draft_model_quantize_refuses(bits, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--draft-model-quantize", bits])
    assert "--draft-model-quantize" in capsys.readouterr().err


def test_per_request_spec_decode_field():
    from mlx_lm_server.http.api_error import APIError
    from mlx_lm_server.http.openai_schema import CompletionRequest

    def cap(value, server_max=6):
        return CompletionRequest(model="m", prompt="x", spec_decode=value).draft_token_cap(server_max)

    assert cap(None) is None and cap(True) is None and cap(False) == 0
    assert cap({"num_speculative_tokens": 6}) == 6
    with pytest.raises(APIError, match="at most 6"):
        cap({"num_speculative_tokens": 7})


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, None),
    (["--api-key", "k1"], {}, "k1"),
    ([], {"MLX_LM_SERVER_API_KEY": "k2"}, "k2"),
    (["--api-key", "k1"], {"MLX_LM_SERVER_API_KEY": "k2"}, "k1"),  # the flag wins
    ([], {"MLX_LM_SERVER_API_KEY": ""}, None),  # set but empty: no key
])
def test_api_key_from_the_flag_or_the_environment(argv, environ, expected):
    args = build_parser().parse_args(["--model", "m", *argv])
    config = config_from_args(args, environ)
    assert config.api_key == expected
    assert expected is None or expected not in repr(config)


def test_api_key_help_names_the_environment_variable():
    help_text = " ".join(build_parser().format_help().split())
    assert "--api-key KEY" in help_text and "MLX_LM_SERVER_API_KEY" in help_text
    assert "/health" in help_text and "x-api-key" in help_text
