"""``mlx-lm-server-models convert``: a Hugging Face checkpoint into a 4-bit
MLX folder that keeps its drafter layer (``mlx_lm_server/models/convert.py``).

Tiny Hugging Face folders with drafter layers whose drafts are mostly right
(``tiny_models.build_mtp_copy``: Qwen3.5's ``mtp.*``; ``build_nextn``:
GLM-4.5's nextn layer ``model.layers.1``): converted with ``--quantize 4``
(float32 scales, this CPU's default), ``--spec-decode auto`` resolves to
``ngram,mtp`` on the folder (or on its split drafter OUT-mtp, found beside
it), the MTP layer drafts (the metrics count its tokens) and greedy output
is the plain model's. A source without the layer converts as mlx-lm would
and ``auto`` says n-gram; a folder whose conversion dropped the layer gets
a start-up line naming the command. Bad input, mlx-lm refusing the source
and a full disk are one error line, with nothing left behind; a
conversion's own 4-bit folder converted again splits a drafter whose config
fits its tensors.
"""

import json
import logging
import shutil

import mlx.core as mx
import pytest
from parity import assert_same_or_near_tie
from test_mtp_proposer import TEXTS, _greedy
from tiny_models import as_qwen35_vlm_original, build, build_mtp_copy, build_nextn

from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.models.cli import main
from mlx_lm_server.server import resolve_sources


def _convert(capsys, *argv) -> tuple[int, list, str]:
    """(exit status, the folders printed, stderr) of ``mlx-lm-server-models convert``."""
    status = main(["convert", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, [line for line in out.splitlines() if not line.startswith("[INFO]")], err


def _auto(*argv):
    """``--spec-decode auto`` resolved on the command line, as the server does."""
    args = build_parser().parse_args(["--spec-decode", "auto", *map(str, argv)])
    return resolve_sources(config_from_args(args)).spec


@pytest.fixture(scope="module")
def sources(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("hf")
    return {"qwen3_5": build_mtp_copy(root / "qwen3_5-mtp", smollm2_path),
            "glm4_moe": build_nextn(root / "glm4_moe-nextn", smollm2_path),
            # A random nextn layer, MoE over a dense layer 0: built at index 1 or not at all.
            "glm4_moe_random": build_nextn(root / "glm4_moe-random", smollm2_path, copy=False,
                                           seed=1),
            "plain": build("qwen3_5", root / "qwen3_5-plain", smollm2_path, seed=3)}


def _same_head(source, folder, draft=None):
    """The drafter as converted (left unquantized) computes what the
    source's own does over the source's target, at every prompt pair and at
    two chained drafts: nothing renamed, shifted, built or chained amiss."""
    from mlx_lm import load

    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head

    model, tokenizer = load(str(source))
    embed = mlx_lm_adapter.token_embedding(model)
    tokens = tokenizer.encode("the cat sat on the mat and the dog")
    hidden = mlx_lm_adapter.text_model(model).model(mx.array([tokens]))
    logits = []
    for head in (load_mtp_head(model, str(source)),
                 load_mtp_head(model, str(folder), draft and str(draft))):
        project = head.projection(mlx_lm_adapter.output_projection(model))
        cache = head.make_cache()
        state = head(embed(mx.array([tokens[1:]])), hidden[:, :-1], cache)
        out = [project(state)]
        for _ in range(2):
            state = head(embed(mx.argmax(out[-1][:, -1:], axis=-1)), state[:, -1:], cache)
            out.append(project(state))
        logits.append(out)
    for a, b in zip(*logits):
        assert mx.abs(a - b).max().item() < 1e-5


def _serves_with_mtp(folder, draft=None):
    """Greedy outputs through what ``auto`` picks on ``folder`` against
    ``none`` (a divergence must be a float32 near-tie); the MTP layer drafts."""
    from mlx_lm import load

    spec = _auto("--model", folder, *(["--draft-model", draft] if draft else []))
    assert spec.mode == "ngram,mtp", spec.mode
    model, tokenizer = load(str(folder))
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    plain, _ = _greedy(model, tokenizer, folder, "none", prompts, 0.05, 16)
    ours, counts = _greedy(model, tokenizer, folder, spec.mode, prompts, 0.05, 16,
                           draft_model_path=spec.draft_model_path)
    for prompt, got, want in zip(prompts, ours, plain):
        assert_same_or_near_tie(model, prompt, got, want, mx.float32)
    drafted, accepted = counts.by_proposer["mtp"]
    assert drafted > 0 and accepted > 0, counts.by_proposer


@pytest.mark.parametrize("family", ["qwen3_5", "glm4_moe"])
def test_a_4bit_conversion_keeps_the_drafter_and_auto_serves_it(sources, family, tmp_path,
                                                                capsys):
    out = tmp_path / f"{family}-4bit"
    status, printed, err = _convert(capsys, sources[family], out, "--quantize", "4",
                                    "--dtype", "float32")
    assert status == 0 and printed == [str(out)], err
    assert "converting tensors" in err and "MTP layer kept" in err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    names = mx.load(str(out / "mtp.safetensors"))
    assert "mtp.fc.weight" in names and "mtp.fc.scales" in names  # quantized like the target
    _serves_with_mtp(out)


def test_a_split_drafter_folder_serves_with_draft_model(sources, tmp_path, capsys):
    """``--split-drafter``: OUT is the target alone, OUT-mtp the drafter;
    ``auto`` takes OUT-mtp as ``--draft-model``, and finds it beside OUT
    without the flag."""
    out = tmp_path / "qwen-4bit"
    status, printed, err = _convert(capsys, sources["qwen3_5"], out, "--quantize", "4",
                                    "--dtype", "float32", "--split-drafter", "--drafter",
                                    "unquantized")
    split = tmp_path / "qwen-4bit-mtp"
    assert status == 0 and printed == [str(out), str(split)], err
    assert not (out / "mtp.safetensors").exists()
    assert json.loads((split / "config.json").read_text())["model_type"] == "qwen3_5_mtp"
    assert "fc.scales" not in mx.load(str(split / "model.safetensors"))  # --drafter unquantized
    spec = _auto("--model", out)  # found beside OUT, with no flag
    assert spec.mode == "ngram,mtp" and spec.draft_model_path == str(split), spec
    _same_head(sources["qwen3_5"], out, split)
    _serves_with_mtp(out)
    _serves_with_mtp(out, draft=split)


@pytest.mark.parametrize("family,split", [("qwen3_5", False), ("glm4_moe_random", False),
                                          ("glm4_moe_random", True)])
def test_a_drafter_left_unquantized_is_the_sources_own(sources, tmp_path, capsys, family,
                                                      split):
    out = tmp_path / "out"
    status, printed, err = _convert(capsys, sources[family], out, "--quantize", "4", "--dtype",
                                    "float32", "--drafter", "unquantized",
                                    *(["--split-drafter"] if split else []))
    assert status == 0, err
    _same_head(sources[family], out, printed[1] if split else None)


def test_a_source_without_the_layer_converts_plainly_and_auto_says_ngram(sources, tmp_path,
                                                                         capsys, caplog):
    out = tmp_path / "plain-4bit"
    status, printed, err = _convert(capsys, sources["plain"], out, "--quantize", "4",
                                    "--dtype", "float32")
    assert status == 0 and printed == [str(out)], err
    assert "has no MTP layer: converted as mlx-lm converts it" in err
    assert not (out / "mtp.safetensors").exists()
    with caplog.at_level(logging.WARNING):
        assert _auto("--model", out).mode == "ngram"
    assert "MTP" not in caplog.text


def test_a_folder_whose_conversion_dropped_the_layer_says_so_at_start_up(sources, tmp_path,
                                                                        caplog):
    """An mlx-community conversion: the config declares the layer, the
    weights lack it (mlx-lm's sanitize dropped ``mtp.*``)."""
    folder = tmp_path / "mlx-community"
    shutil.copytree(sources["plain"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        assert _auto("--model", folder).mode == "ngram"
    assert "holds none of their weights: its conversion dropped them" in caplog.text
    assert f"mlx-lm-server-models add-drafter {folder} --from ORIGINAL" in caplog.text


def _broken(source, folder, change):
    shutil.copytree(source, folder)
    change(folder)
    return folder


def _without(key):
    def change(folder):
        path = folder / "model.safetensors"
        weights = {k: v for k, v in mx.load(str(path)).items() if k != key}
        mx.save_safetensors(str(path), weights)
    return change


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _unknown_family(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="qwen9_moe")))


def _index_names_a_missing_shard(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))


@pytest.mark.parametrize("change,says", [
    (_truncate, "is truncated"),
    (_index_names_a_missing_shard, "model-00002-of-00002.safetensors (named in"),
    (_unknown_family, "model_type 'qwen9_moe' is not a family"),
    (_without("mtp.layers.0.mlp.down_proj.weight"), "do not fit: Missing 1 parameters: "
                                                    "layers.0.mlp.down_proj.weight."),
    (_without("mtp.fc.weight"), "incomplete (missing mtp.fc.weight)"),
    (lambda folder: (folder / "config.json").unlink(), "has no config.json"),
    # A target's layer norm missing: mlx-lm's load refuses it (its ValueError, one line here).
    (_without("language_model.model.layers.0.input_layernorm.weight"),
     "Missing 1 parameters: language_model.model.layers.0.input_layernorm.weight"),
])
def test_bad_input_is_one_error_line(sources, tmp_path, capsys, change, says):
    source = _broken(sources["qwen3_5"], tmp_path / "broken", change)
    status, printed, err = _convert(capsys, source, tmp_path / "out", "--quantize", "4")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1 and printed == [] and len(errors) == 1, err
    assert says in errors[0] and err.strip().endswith(errors[0]), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def _fits(quantization, weights):
    """Every quantized tensor of ``weights`` has the shapes the config's bits
    and group size (the layer's own, else the global ones) give it."""
    for key in [k for k in weights if k.endswith(".scales")]:
        layer = key[: -len(".scales")]
        own = quantization.get(layer)
        bits, group = (own or quantization)["bits"], (own or quantization)["group_size"]
        inputs = weights[key].shape[-1] * group
        assert weights[layer + ".weight"].shape[-1] * 32 == inputs * bits, (layer, bits, group)


def test_an_already_quantized_folder_converted_again_splits_a_drafter_that_fits(sources,
                                                                                  tmp_path,
                                                                                  capsys):
    """A conversion's own 4-bit folder converted again with ``--split-drafter``:
    the split drafter's config says the bits its tensors have, it loads and
    drafts what the folder's own drafter does. Requantizing is refused."""
    first = tmp_path / "qwen-4bit"
    status, _, err = _convert(capsys, sources["qwen3_5"], first, "--quantize", "4",
                              "--dtype", "float32")
    assert status == 0, err
    out = tmp_path / "again"
    status, printed, err = _convert(capsys, first, out, "--split-drafter")
    split = tmp_path / "again-mtp"
    assert status == 0 and printed == [str(out), str(split)], err
    config = json.loads((split / "config.json").read_text())
    weights = mx.load(str(split / "model.safetensors"))
    assert "fc.scales" in weights and config["quantization"]["bits"] == 4
    _fits(config["quantization"], weights)
    _same_head(first, out, split)

    status, printed, err = _convert(capsys, first, tmp_path / "eight", "--quantize", "8",
                                    "--split-drafter")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1 and printed == [] and len(errors) == 1, err
    assert "already quantized (4-bit" in errors[0], errors
    assert not (tmp_path / "eight").exists() and not (tmp_path / "eight-mtp").exists()


def test_a_full_disk_while_writing_is_one_error_line(sources, tmp_path, capsys, monkeypatch):
    """The writer fails half way (ENOSPC): one line, and nothing left behind
    (no OUT, no temporary folder), so that a rerun works."""
    import errno
    import os

    import mlx_lm.utils

    def full_disk(path, *args, **kwargs):
        (path / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mlx_lm.utils, "save_model", full_disk)
    status, printed, err = _convert(capsys, sources["qwen3_5"], tmp_path / "out", "--quantize",
                                    "4", "--dtype", "float32")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1 and printed == [] and len(errors) == 1, err
    assert "No space left on device" in errors[0] and str(tmp_path / "out") in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_vlm_layout_original_keeps_its_mtp_layer(tmp_path_factory, smollm2_path, tmp_path,
                                                   capsys):
    """A Qwen3.5 original as Hugging Face lays it out (a vision-language
    checkpoint: ``model.language_model.*``, ``model.visual.*``, ``mtp.*``):
    the converted folder is mlx-lm's (text only, the tower dropped) with the
    MTP layer kept, and ``auto`` drafts with it."""
    pytest.importorskip("mlx_vlm")
    original = as_qwen35_vlm_original(
        build_mtp_copy(tmp_path_factory.mktemp("hf") / "qwen3_5-vl", smollm2_path))
    out = tmp_path / "qwen3_5-vl-4bit"
    status, printed, err = _convert(capsys, original, out, "--quantize", "4", "--dtype",
                                    "float32")
    assert status == 0 and printed == [str(out)], err
    assert "MTP layer kept" in err and (out / "mtp.safetensors").exists()
    _serves_with_mtp(out)
