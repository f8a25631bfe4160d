"""``mlx-lm-server-models add-drafter TARGET --from ORIGINAL``: the drafter
layer a conversion dropped, grafted from the original's shards that hold it
(``mlx_lm_server/models/graft.py``).

Tiny Hugging Face originals whose drafter layer sits in a shard of its own
(``tiny_models.shard_drafter_apart``: Qwen3.5's ``mtp.*``, GLM-4.5's nextn
layer), converted to 4 bits by plain ``mlx_lm.convert`` (which drops the
layer, as every mlx-community folder has), then grafted from a copy of the
original whose other shards are deleted: the grafted tensors and config are
what ``convert`` writes from the whole original (inside, or split as
TARGET-mtp), ``--spec-decode auto`` drafts with the layer and greedy output
is the plain model's. From a hub id only the index and the drafter's shard
are downloaded. A mismatched original, a missing shard and a target that
already holds the layer are one error line, and the target is left as it
was.
"""

import hashlib
import json
import shutil

import mlx.core as mx
import pytest
from test_convert import _auto, _serves_with_mtp
from tiny_models import as_qwen35_vlm_original, build_mtp_copy, build_nextn, shard_drafter_apart

from mlx_lm_server.models.cli import main

DRAFTER_SHARD = "model-00002-of-00002.safetensors"


def _run(capsys, *argv) -> tuple[int, list, str]:
    """(exit status, the folders printed, stderr) of ``mlx-lm-server-models``."""
    status = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return status, [line for line in out.splitlines() if not line.startswith("[INFO]")], err


def _one_error(status, printed, err) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1 and printed == [] and len(errors) == 1, err
    assert err.strip().endswith(errors[0]) and "Traceback" not in err, err
    return errors[0]


@pytest.fixture(scope="module")
def originals(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("hf")
    return {"qwen3_5": shard_drafter_apart(build_mtp_copy(root / "qwen3_5", smollm2_path)),
            "glm4_moe": shard_drafter_apart(build_nextn(root / "glm4_moe", smollm2_path))}


@pytest.fixture(scope="module")
def community(tmp_path_factory, originals):
    """The originals as mlx-lm converts them to 4 bits: the drafter dropped."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("mlx-community")
    folders = {}
    for family, original in originals.items():
        folders[family] = root / f"{family}-4bit"
        convert(str(original), str(folders[family]), quantize=True, q_bits=4)
    return folders


def _pruned(original, folder):
    """A copy of ``original`` with only the shard that holds the drafter."""
    shutil.copytree(original, folder)
    (folder / "model-00001-of-00002.safetensors").unlink()
    return folder


def _files(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _same_tensors(a, b):
    a, b = mx.load(str(a)), mx.load(str(b))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k


@pytest.mark.parametrize("family,split", [("qwen3_5", False), ("glm4_moe", False),
                                          ("qwen3_5", True), ("glm4_moe", True)])
def test_a_graft_is_what_convert_writes_and_drafts(originals, community, tmp_path, capsys,
                                                   family, split):
    target = tmp_path / "target"
    shutil.copytree(community[family], target)
    assert _auto("--model", target).mode == "ngram"  # mlx-lm dropped the layer
    before = _files(target)
    pruned = _pruned(originals[family], tmp_path / "original")
    status, printed, err = _run(capsys, "add-drafter", target, "--from", pruned,
                                *(["--split"] if split else []))
    written = tmp_path / "target-mtp" if split else target
    assert status == 0 and printed == [str(written)], err
    assert f"({DRAFTER_SHARD})" in err and "4-bit" in err

    converted = tmp_path / "converted"
    status, _, err = _run(capsys, "convert", originals[family], converted, "--quantize", "4",
                          "--dtype", "float32", *(["--split-drafter"] if split else []))
    assert status == 0, err
    if split:
        assert _files(target) == before  # TARGET itself untouched
        _same_tensors(written / "model.safetensors", tmp_path / "converted-mtp/model.safetensors")
        ours, theirs = (json.loads((f / "config.json").read_text())
                        for f in (written, tmp_path / "converted-mtp"))
        assert {**ours, "converted_from": ""} == {**theirs, "converted_from": ""}
        assert ours["quantization"]["bits"] == 4
    else:
        _same_tensors(target / "mtp.safetensors", converted / "mtp.safetensors")
        ours, theirs = (json.loads((f / "config.json").read_text())["quantization"]
                        for f in (target, converted))
        assert {k: v for k, v in ours.items() if k.startswith("mtp.")} == \
            {k: v for k, v in theirs.items() if k.startswith("mtp.")}
    spec = _auto("--model", target)
    assert spec.draft_model_path == (str(written) if split else None), spec
    _serves_with_mtp(target)


def test_from_the_hub_only_the_index_and_the_drafters_shard_are_downloaded(
        originals, community, tmp_path, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    asked = []

    def download(repo_id, filename, **kwargs):
        assert repo_id == "org/tiny-qwen3.5"
        asked.append(filename)
        if not (originals["qwen3_5"] / filename).exists():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(originals["qwen3_5"] / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    target = tmp_path / "target"
    shutil.copytree(community["qwen3_5"], target)
    status, printed, err = _run(capsys, "add-drafter", target, "--from", "org/tiny-qwen3.5")
    assert status == 0 and printed == [str(target)], err
    assert asked == ["config.json", "model.safetensors.index.json", DRAFTER_SHARD]
    assert _auto("--model", target).mode == "ngram,mtp"


def _config_edit(**changes):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        config["text_config"].update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return change


@pytest.mark.parametrize("original,change,says", [
    ("glm4_moe", None, "is not the original of"),
    ("qwen3_5", _config_edit(hidden_size=128), "hidden_size 128 against 64"),
    ("qwen3_5", _config_edit(vocab_size=2048), "vocab_size 2048 against 49152"),
    ("qwen3_5", _config_edit(num_hidden_layers=2), "num_hidden_layers 2 against 1"),
    ("qwen3_5", lambda folder: (folder / DRAFTER_SHARD).unlink(),
     f"{DRAFTER_SHARD} (which holds its MTP layer) missing"),
    ("qwen3_5", lambda folder: (folder / DRAFTER_SHARD).write_bytes(
        (folder / DRAFTER_SHARD).read_bytes()[:-100]), "is truncated"),
])
def test_a_graft_that_cannot_be_is_one_line_and_leaves_the_target(
        originals, community, tmp_path, capsys, original, change, says):
    pruned = _pruned(originals[original], tmp_path / "original")
    if change:
        change(pruned)
    before = _files(community["qwen3_5"])
    error = _one_error(*_run(capsys, "add-drafter", community["qwen3_5"], "--from", pruned))
    assert says in error, error
    assert _files(community["qwen3_5"]) == before
    assert not (community["qwen3_5"].parent / "qwen3_5-4bit-mtp").exists()


@pytest.mark.parametrize("split", [False, True])
def test_a_target_that_holds_the_layer_is_refused_unless_replace(originals, community,
                                                                 tmp_path, capsys, split):
    """Grafted once, a second graft is refused (and a split one onto a target
    holding the layer inside); ``--replace`` writes it again, the old one
    swapped out with nothing left beside."""
    flags = ["--split"] if split else []
    target = tmp_path / "target"
    shutil.copytree(community["qwen3_5"], target)
    written = tmp_path / "target-mtp" if split else target
    pruned = _pruned(originals["qwen3_5"], tmp_path / "original")
    assert _run(capsys, "add-drafter", target, "--from", pruned, *flags)[0] == 0
    grafted = _files(written)
    error = _one_error(*_run(capsys, "add-drafter", target, "--from", pruned, *flags))
    assert ("target-mtp exists: --replace replaces it" if split
            else "already holds its MTP layer") in error, error
    if not split:
        error = _one_error(*_run(capsys, "add-drafter", target, "--from", pruned, "--split",
                                 "--replace"))
        assert "which a split drafter beside it would not replace" in error, error
    assert _files(written) == grafted
    status, printed, err = _run(capsys, "add-drafter", target, "--from", pruned, "--replace",
                                *flags)
    assert status == 0 and printed == [str(written)] and _files(written) == grafted, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["original", "target"] + (["target-mtp"] if split else []))
    assert not [p for p in target.iterdir() if p.name.startswith(".")]


def test_a_vlm_target_is_grafted_its_vision_tower_kept(tmp_path_factory, smollm2_path, capsys):
    """Qwen3.5 checkpoints are vision-language ones: mlx-vlm's conversion
    (what mlx-community's Qwen3.5 folders are) keeps the vision tower and
    drops ``mtp.*``; the graft puts the layer back beside the tower, which
    mlx-vlm still loads, and ``auto`` drafts with it."""
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.convert import convert
    from mlx_vlm.utils import load_model

    root = tmp_path_factory.mktemp("vlm")
    model = build_mtp_copy(root / "model", smollm2_path)
    original = as_qwen35_vlm_original(shutil.copytree(model, root / "original"))
    # The same weights in the layout whose norms mlx-vlm leaves as they are.
    unshifted = as_qwen35_vlm_original(shutil.copytree(model, root / "unshifted"),
                                       language="language_model.model.")
    target = root / "qwen3_5-vl-4bit"
    convert(str(unshifted), str(target), quantize=True, q_bits=4)
    assert _auto("--model", target).mode == "ngram"  # mlx-vlm dropped the layer
    status, printed, err = _run(capsys, "add-drafter", target, "--from", original)
    assert status == 0 and printed == [str(target)], err
    assert any(k.startswith("vision_tower.") for k in mx.load(str(target / "model.safetensors")))
    assert json.loads((target / "config.json").read_text())["vision_config"]
    load_model(target)  # mlx-vlm reads the folder, the grafted layer beside it
    _serves_with_mtp(target)
