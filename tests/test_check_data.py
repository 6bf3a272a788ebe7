"""The data doctor on generated CoOp DATA folders: every problem found, with what to do, read-only."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
from conftest import REPO
from PIL import Image

from coop.data import doctor
from coop.data.catalog import DOWNLOADS
from coop.data.datasets import IMAGENET_LAYOUT, SPLIT_JSON_LAYOUTS
from coop.data.doctor import check_dataset, format_reports
from coop.data.imagenet_variants import IMAGENET_VARIANTS

SIZES = {"train": 3, "val": 1, "test": 2}  # per class
CLASSES = ["banded", "dotted"]


def check_data(*args) -> int:
    spec = importlib.util.spec_from_file_location("coop_tool_check_data", REPO / "tools" / "check_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def image(path, colour=(120, 60, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def split_dataset(data, name="dtd"):
    """A CoOp-layout dataset read from a split_zhou_*.json: 2 classes, SIZES images per split."""
    folder, images, split_name = SPLIT_JSON_LAYOUTS[name]
    split = {}
    for s, n in SIZES.items():
        split[s] = [[f"{c}/{s}_{i}.jpg", label, c] for label, c in enumerate(CLASSES) for i in range(n)]
        for rel, _, _ in split[s]:
            image(data / folder / images / rel)
    (data / folder / split_name).write_text(json.dumps(split))
    return data / folder


def variant(data, name="imagenet_a", wnids=("n01", "n02")):
    v = IMAGENET_VARIANTS[name]
    (data / v.folder).mkdir(parents=True)
    (data / v.folder / "classnames.txt").write_text("n01 goldfish\nn02 great white shark\nn03 tench\n")
    for w in wnids:
        for i in range(2):
            image(data / v.folder / v.images / w / f"{i}.jpg")


def imagenet(data):
    folder, images, classes = IMAGENET_LAYOUT
    (data / folder).mkdir(parents=True)
    (data / folder / classes).write_text("n01 goldfish\nn02 great white shark\n")
    for split in ("train", "val"):
        for w in ("n01", "n02"):
            image(data / folder / images / split / w / "0.jpg")


def snapshot(root):
    return sorted(
        (os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_mtime_ns)
        for d, dirs, files in os.walk(root)
        for f in files + dirs
    )


@pytest.fixture
def published_as_generated(monkeypatch):
    """CoOp's sizes for dtd set to the generated ones, so that a healthy fixture passes."""
    sizes = {**doctor.COOP_SPLIT_SIZES, "dtd": (2, 6, 2, 4)}
    monkeypatch.setattr(doctor, "COOP_SPLIT_SIZES", sizes)


def problems(report) -> str:
    return "\n".join(f"{p} -> {f}" for p, f in report.problems)


def test_healthy_then_each_problem(tmp_path, published_as_generated):
    data = tmp_path / "DATA"
    folder = split_dataset(data)
    report = check_dataset("dtd", data, sample=None)
    assert report.ok, problems(report)
    assert report.counts == {"classes": 2, "train": 6, "val": 2, "test": 4}

    # a missing image, and a corrupt one (found when every image is decoded)
    (folder / "images" / "banded" / "train_0.jpg").unlink()
    (folder / "images" / "dotted" / "test_1.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    text = problems(check_dataset("dtd", data, sample=None))
    assert "1 of 12 images listed in the split are missing" in text and "train_0.jpg" in text
    assert "1 of all 11 images do not decode" in text and "test_1.jpg" in text
    assert f"fetch dtd-r1.0.1.tar.gz from {DOWNLOADS['dtd']['images'][1]}" in text
    assert "data.skip_corrupt=true" in text

    # a split file that does not parse, then a missing one
    split = folder / SPLIT_JSON_LAYOUTS["dtd"][2]
    split.write_text("{not json")
    text = problems(check_dataset("dtd", data))
    assert "the reader cannot use it: malformed JSON file" in text and DOWNLOADS["dtd"]["files"][1] in text
    split.unlink()
    report = check_dataset("dtd", data)
    assert report.problems == [
        (
            f"{split} is missing",
            f"fetch split_zhou_DescribableTextures.json from {DOWNLOADS['dtd']['files'][1]} and put it at {split}",
        )
    ]


def test_wrong_counts_against_coop(tmp_path):
    data = tmp_path / "DATA"
    split_dataset(data, "eurosat")
    text = problems(check_dataset("eurosat", data))
    assert "2 classes, CoOp's split has 10" in text
    assert (
        "6 train images, CoOp's split has 13,500" in text and "4 test images, CoOp's split has 8,100" in text
    )
    assert "split_zhou_EuroSAT.json" in text
    report = check_dataset("eurosat", data)
    assert report.usable and not report.ok and not report.errors and len(report.differences) == 4
    # an empty split is not a size difference: a run would fail without it
    split = data / "eurosat" / SPLIT_JSON_LAYOUTS["eurosat"][2]
    split.write_text(json.dumps({**json.loads(split.read_text()), "val": []}))
    report = check_dataset("eurosat", data)
    assert not report.usable and report.errors[0][0] == "0 val images, CoOp's split has 5,400"
    variant(data, "imagenet_a")
    text = problems(check_dataset("imagenet_a", data))
    assert "2 classes, CoOp's split has 200" in text and "4 test images, CoOp's split has 7,500" in text
    assert "github.com/hendrycks/natural-adv-examples" in text


@pytest.mark.parametrize("where", ["renamed", "nested"])
def test_misplaced_folder(tmp_path, where, published_as_generated):
    data = tmp_path / "DATA"
    folder = split_dataset(data)
    moved = data / "DTD" if where == "renamed" else data / "dtd" / "dtd-r1.0.1"
    tmp = tmp_path / "x"
    shutil.move(folder, tmp)
    moved.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(tmp, moved)
    report = check_dataset("dtd", data)
    assert len(report.problems) == 1, problems(report)
    assert report.problems[0][1] == f"move {moved} to {folder}"
    shutil.move(moved, tmp)
    shutil.rmtree(data / "dtd", ignore_errors=True)
    shutil.move(tmp, folder)
    assert check_dataset("dtd", data).ok


def test_missing_classnames_of_a_variant(tmp_path):
    data = tmp_path / "DATA"
    variant(data, "imagenet_r")
    (data / "imagenet-rendition" / "classnames.txt").unlink()
    (problem, fix), *_ = check_dataset("imagenet_r", data).problems
    assert problem.endswith("imagenet-rendition/classnames.txt is missing")
    assert fix.startswith("fetch classnames.txt from <DATA>/imagenet/ (copy it")


def test_tool_table_exit_status_and_read_only(tmp_path, capsys, published_as_generated):
    data = tmp_path / "DATA"
    split_dataset(data)
    imagenet(data)
    split_dataset(data, "eurosat")
    before = snapshot(data)
    assert check_data(data, "--dataset", "dtd", "--full") == 0
    out = capsys.readouterr().out
    assert "| dtd | ok | 2 | 6 | 2 | 4 |" in out and "1 of 1 dataset(s) usable" in out
    assert check_data(data, "--dataset", "dtd", "imagenet", "eurosat", "oxford_pets") == 1
    out = capsys.readouterr().out
    # other sizes than CoOp's split: usable, a difference (2 classes, not 1000; train; test)
    assert "| imagenet | usable, differs from CoOp's split (3) | 2 | 2 | 2 | 2 |" in out
    assert "| eurosat | usable, differs from CoOp's split (4) |" in out
    assert "| oxford_pets | not usable: 2 error(s) | – |" in out  # its folder is missing
    assert (
        "- oxford_pets (error): " in out
        and "split_zhou_OxfordPets.json from https://drive.google.com/" in out
    )
    assert "- eurosat (differs): 2 classes, CoOp's split has 10" in out
    assert "3 of 4 dataset(s) usable" in out and "2 of them differ from CoOp's split sizes" in out
    # repeated --dataset adds up; differences pass unless --strict
    assert check_data(data, "--dataset", "dtd", "--dataset", "eurosat") == 0
    out = capsys.readouterr().out
    assert "| dtd | ok |" in out and "| eurosat | usable" in out and "2 of 2 dataset(s) usable" in out
    assert check_data(data, "--dataset", "dtd", "--dataset", "eurosat", "--strict") == 1
    assert check_data(data, "--dataset", "dtd", "--strict") == 0
    capsys.readouterr()
    assert snapshot(data) == before  # nothing written into DATA (no ImageNet listing cache either)
    # any image folder, also through a split file
    folder = tmp_path / "mine"
    for c in ("a", "b"):
        for s in ("train", "test"):
            image(folder / s / c / "0.png")
    assert check_data(folder, "--dataset", "imagefolder") == 0
    (problem, fix), *_ = check_dataset("imagefolder", folder, split_file=tmp_path / "none.json").problems
    assert problem.endswith("none.json is missing") and "tools/make_split.py" in fix
    split = tmp_path / "split.json"
    split.write_text(
        json.dumps(
            {s: [[f"{s}/a/0.png", 0, "a"], [f"{s}/b/0.png", 1, "b"]] for s in ("train", "val", "test")}
        )
    )
    (folder / "val" / "a").mkdir(parents=True)
    (folder / "val" / "a" / "0.png").write_bytes(b"broken")
    assert check_data(folder, "--dataset", "imagefolder", "--split-file", split, "--full") == 1
    assert "1 of all 5 images do not decode" in capsys.readouterr().out  # val/b/0.png is missing
    with pytest.raises(FileNotFoundError, match="DATA folder not found"):
        check_data(tmp_path / "nowhere")
    assert "| dtd | not usable: 2 error(s) |" in format_reports(
        [check_dataset("dtd", tmp_path / "empty_data")]
    )


def test_descriptions(tmp_path, capsys, published_as_generated):
    data = tmp_path / "DATA"
    split_dataset(data)
    long = "a texture of " + "many " * 80 + "bands."  # 85 tokens and [SOS], [EOS]: 87, over 77
    path = tmp_path / "dtd.json"
    path.write_text(json.dumps({"banded": ["bands of colour.", long, long + " more"], "Dotted": ["dots."]}))
    assert check_data(data, "--dataset", "dtd", "--descriptions", path) == 0  # usable: truncated
    out = capsys.readouterr().out
    assert "| dtd | ok |" in out
    lines = [line for line in out.splitlines() if line.startswith("- dtd")]
    assert lines == [
        f"- dtd (warning): {path}: 2 of 3 sentences of class 'banded' are longer than the tokenizer's "
        "context of 77 tokens (the longest: 88) -> shorten them: a run truncates them to the context "
        "(the originals refuse them)"
    ]
    # a class without an entry, and one with an empty list: one error line each, naming the class
    path.write_text(json.dumps({"banded": [], "spotted": ["spots."]}))
    assert check_data(data, "--dataset", "dtd", "--descriptions", path) == 1
    out = capsys.readouterr().out
    assert "| dtd | not usable: 2 error(s) |" in out
    assert f"- dtd (error): {path} has an empty list for class 'banded' -> add its sentences" in out
    assert f"- dtd (error): {path} has no sentences for class 'dotted' -> add its sentences" in out
    path.write_text("[1, 2]")
    assert check_data(data, "--dataset", "dtd", "--descriptions", path) == 1
    assert "must hold a JSON object" in capsys.readouterr().out
    # a smaller context: the tiny tokenizer of another model counts its own tokens
    report = check_dataset(
        "dtd", data, descriptions=tmp_path / "none.json", tokens=(lambda s: len(s.split()), 3)
    )
    assert report.errors[0][0] == f"data.descriptions: {tmp_path / 'none.json'} does not exist"
    path.write_text(json.dumps({"banded": ["one two three four"], "dotted": ["one two three"]}))
    report = check_dataset("dtd", data, descriptions=path, tokens=(lambda s: len(s.split()), 3))
    assert report.usable and [p for p, _ in report.warnings] == [
        f"{path}: 1 of 1 sentences of class 'banded' are longer than the tokenizer's context of 3 tokens "
        "(the longest: 4)"
    ]
    with pytest.raises(SystemExit):
        check_data(data, "--dataset", "dtd", "eurosat", "--descriptions", path)
    assert "describes one dataset" in capsys.readouterr().err
