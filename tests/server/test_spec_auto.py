"""``--spec-decode auto`` (the default): prompt lookup, mixed
with the drafter the model comes with, told apart by the folders' configs
and tensor names; prompt lookup alone where there is none."""

import json
import shutil

import pytest
from tiny_models import CONFIGS, build, build_dflash, build_eagle3

from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.server import resolve_sources
from mlx_lm_server.spec_decode.auto import auto_mode, has_mtp_layer


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("auto")
    with_mtp = build("qwen3_5_mtp", root / "with-mtp", smollm2_path, seed=3)
    # An mlx-lm conversion: the config still declares the layer, the weights are gone.
    converted = build("qwen3_5", root / "converted", smollm2_path, seed=3)
    config = json.loads((converted / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (converted / "config.json").write_text(json.dumps(config))
    split = root / "split-mtp"
    split.mkdir()
    (split / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp"}))
    text_config = CONFIGS["qwen3_5"]["text_config"]
    return {"with_mtp": with_mtp, "converted": converted, "split": split,
            "eagle3": build_eagle3(root / "eagle3", json.loads(
                (smollm2_path / "config.json").read_text())),
            "dflash": build_dflash(root / "dflash", text_config, [0, 1, 3]),
            "smollm2": smollm2_path}


def test_auto_picks_the_drafter_the_folders_hold(folders):
    assert has_mtp_layer(str(folders["with_mtp"]))
    assert auto_mode(str(folders["with_mtp"])) == "ngram,mtp"
    assert not has_mtp_layer(str(folders["converted"]))
    assert auto_mode(str(folders["converted"])) == "ngram"
    assert auto_mode(str(folders["smollm2"])) == "ngram"
    target = str(folders["converted"])
    assert auto_mode(target, str(folders["eagle3"])) == "ngram,eagle3"
    assert auto_mode(target, str(folders["dflash"])) == "ngram,dflash"
    assert auto_mode(target, str(folders["split"])) == "ngram,mtp"
    assert auto_mode(target, str(folders["smollm2"])) == "ngram,draft"


def test_the_command_line_resolves_auto_before_anything_loads(folders, tmp_path):
    def resolved(*argv):
        return resolve_sources(config_from_args(build_parser().parse_args(list(argv)))).spec

    spec = resolved("--model", str(folders["with_mtp"]), "--spec-decode", "auto")
    assert spec.mode == "ngram,mtp" and spec.uses_mtp
    spec = resolved("--model", str(folders["smollm2"]), "--spec-decode", "auto",
                    "--draft-model", str(folders["eagle3"]))
    assert spec.mode == "ngram,eagle3" and spec.draft_model_path == str(folders["eagle3"])
    assert resolved("--model", str(folders["smollm2"]), "--spec-decode", "auto").mode == "ngram"
    # A draft folder without a readable config is an error naming it.
    empty = tmp_path / "empty"
    shutil.copytree(folders["split"], empty)
    (empty / "config.json").unlink()
    with pytest.raises(ValueError, match="no readable config.json"):
        resolved("--model", str(folders["smollm2"]), "--spec-decode", "auto",
                 "--draft-model", str(empty))


def _resolved(*argv):
    return resolve_sources(config_from_args(build_parser().parse_args(list(argv))))


def test_without_the_flag_the_server_speculates_and_says_what_it_chose(folders, caplog):
    caplog.set_level("INFO", logger="mlx_lm_server")
    assert config_from_args(build_parser().parse_args(["--model", "m"])).spec.mode == "auto"
    assert _resolved("--model", str(folders["with_mtp"])).spec.mode == "ngram,mtp"
    assert "ngram,mtp (prompt lookup mixed per row with the checkpoint's own MTP layer" \
        in caplog.text
    spec = _resolved("--model", str(folders["smollm2"]), "--draft-model",
                     str(folders["eagle3"])).spec
    assert spec.mode == "ngram,eagle3"  # --draft-model alone: auto tells the folder apart
    assert _resolved("--model", str(folders["smollm2"]), "--spec-decode", "none").spec.mode \
        == "none"


def test_a_split_drafter_beside_the_model_is_found_without_a_flag(folders, tmp_path, caplog):
    target = tmp_path / "model-4bit"
    shutil.copytree(folders["converted"], target)
    caplog.set_level("WARNING")
    assert _resolved("--model", str(target)).spec.mode == "ngram"
    assert f"add-drafter {target} --from ORIGINAL" in caplog.text  # the dropped layer's line
    shutil.copytree(folders["split"], tmp_path / "model-4bit-mtp")
    spec = _resolved("--model", str(target)).spec
    assert (spec.mode, spec.draft_model_path) == ("ngram,mtp", str(tmp_path / "model-4bit-mtp"))


def test_a_server_started_without_the_flag_drafts_and_keeps_plain_output(folders, live_server):
    """The command line's default server on SmolLM2 (``auto``: prompt lookup)
    against the plain server: a code edit drafts tokens, greedy text equal."""
    import httpx
    from conftest import LiveServer

    spec = _resolved("--model", str(folders["smollm2"])).spec
    server = LiveServer(folders["smollm2"], spec=spec)
    try:
        code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(6))
        body = {"model": live_server.model, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "Repeat this code exactly:\n\n" + code}]}
        texts = [httpx.post(s.url + "/v1/chat/completions", json={**body, "model": s.model},
                            timeout=120).json()["choices"][0]["message"]["content"]
                 for s in (live_server, server)]
        metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=5).json()
    finally:
        server.close()
    assert texts[0] == texts[1]
    assert metrics["mode"] == "ngram" and metrics["totals"]["accepted_tokens"] > 0, metrics
