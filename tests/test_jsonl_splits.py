"""2SFS's released few-shot splits (data.fewshot_source=jsonl): exactly the listed images, matched to
this DATA folder by their path inside the image folder; an entry that does not resolve refused in one
line before the run folder exists; and the data doctor's check of the files."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import REPO, make_image_folder, run_tool_in_process, tiny_args
from PIL import Image

import coop.train.runner
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.data import build_dataset
from coop.data.base import DataError
from coop.data.doctor import check_dataset
from coop.data.jsonl_splits import jsonl_path

CLASSES = ["banded", "dotted"]


def dtd(data):
    """DATA/dtd in CoOp's layout: 2 classes, 4 train, 2 val, 1 test images each."""
    split = {}
    for s, n in (("train", 4), ("val", 2), ("test", 1)):
        split[s] = [[f"{c}/{s}_{i}.jpg", label, c] for label, c in enumerate(CLASSES) for i in range(n)]
        for rel, _, _ in split[s]:
            (data / "dtd" / "images" / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8)).save(data / "dtd" / "images" / rel)
    (data / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    return data / "dtd" / "images"


def write_jsonl(path, entries):
    """2SFS's lines: the authors' absolute paths, their labels, domain 0 (`Datum.__dict__` dumped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"_impath": p, "_label": label, "_domain": 0, "_classname": CLASSES[label % 2]})
        for p, label in entries
    ]
    path.write_text("\n".join(lines) + "\n")


TRAIN = [  # the authors' machine: other roots, one of them Windows'
    ("/home/authors/data/dtd/images/banded/train_3.jpg", 0),
    ("/home/authors/data/dtd/images/banded/train_0.jpg", 0),
    ("C:\\datasets\\dtd\\images\\dotted\\train_2.jpg", 1),
    ("/mnt/x/DATA/dtd/images/dotted/train_1.jpg", 1),
]
VAL = [
    ("/home/authors/data/dtd/images/dotted/val_1.jpg", 1),
    ("/home/authors/data/dtd/images/banded/val_0.jpg", 0),
]


def test_exactly_the_listed_images(tmp_path, caplog):
    data = tmp_path / "DATA"
    images = dtd(data)
    write_jsonl(jsonl_path(data / "dtd", 2, 3, "train"), TRAIN)
    write_jsonl(jsonl_path(data / "dtd", 2, 3, "val"), VAL)
    ds = build_dataset("dtd", data, shots=2, seed=3, fewshot_source="jsonl")
    assert [(d.path, d.label, d.classname) for d in ds.train] == [
        (str(images / "banded/train_3.jpg"), 0, "banded"),
        (str(images / "banded/train_0.jpg"), 0, "banded"),
        (str(images / "dotted/train_2.jpg"), 1, "dotted"),
        (str(images / "dotted/train_1.jpg"), 1, "dotted"),
    ]
    assert [(d.path, d.label) for d in ds.val] == [
        (str(images / "dotted/val_1.jpg"), 1),
        (str(images / "banded/val_0.jpg"), 0),
    ]
    assert len(ds.test) == 2 and ds.shots == 2 and ds.seed == 3
    # nothing cached beside the files; our own draw is still there for the same K and seed
    assert sorted(p.name for p in (data / "dtd" / "split_fewshot").iterdir()) == [
        "shot_2-seed_3_train.jsonl",
        "shot_2-seed_3_val.jsonl",
    ]
    drawn = build_dataset("dtd", data, shots=2, seed=3)
    assert len(drawn.train) == 4 and (data / "dtd" / "split_fewshot" / "shot_2-seed_3.json").is_file()
    # no val file (ImageNet's case): the val images are our draw's, said in a warning
    jsonl_path(data / "dtd", 2, 3, "val").unlink()
    with caplog.at_level(logging.WARNING, logger="coop.data.jsonl_splits"):
        ds = build_dataset("dtd", data, shots=2, seed=3, fewshot_source="jsonl")
    assert ds.val == drawn.val and len(ds.train) == 4
    assert "shot_2-seed_3_val.jsonl does not exist: the val images are CoOp's draw" in caplog.text


def test_bad_entries_are_one_line(tmp_path):
    data = tmp_path / "DATA"
    images = dtd(data)
    train = jsonl_path(data / "dtd", 2, 1, "train")
    where = f"data.fewshot_source=jsonl: {train}"
    with pytest.raises(DataError, match=f"^{where} does not exist$"):
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    bad = "/home/authors/data/dtd/images/banded/train_9.jpg"
    write_jsonl(train, [*TRAIN[:2], (bad, 0)])
    with pytest.raises(DataError) as e:
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    assert str(e.value) == f"{where} line 3: {bad} is no image of dtd's train split under {images}"
    test_image = "/home/authors/data/dtd/images/banded/test_0.jpg"  # not a shot: a test image
    write_jsonl(train, [(test_image, 0)])
    with pytest.raises(DataError, match=r"line 1: .*test_0.jpg is no image of dtd's train split"):
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    write_jsonl(train, [VAL[0]])  # a val image is no shot either
    with pytest.raises(DataError, match=r"line 1: .*val_1.jpg is no image of dtd's train split"):
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    write_jsonl(train, [TRAIN[0], (TRAIN[2][0], 0)])
    with pytest.raises(DataError) as e:
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    assert str(e.value) == (
        f"{where} line 2: {TRAIN[2][0]} has _label 0, but dtd labels {images / 'dotted/train_2.jpg'} 1"
    )
    train.write_text('{"_impath": "a.jpg"}\n')
    with pytest.raises(
        DataError, match=r"line 1 is not an object with a string _impath and an integer _label$"
    ):
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    train.write_text("\n{not json\n")
    with pytest.raises(DataError, match=r"line 2 is not JSON"):
        build_dataset("dtd", data, shots=2, seed=1, fewshot_source="jsonl")
    with pytest.raises(DataError, match="data.shots must be >= 1, got 0"):
        build_dataset("dtd", data, shots=0, fewshot_source="jsonl")


def test_run_uses_them_and_refuses_before_the_run_folder(tmp_path, monkeypatch):
    folder = make_image_folder(tmp_path / "mine", n_train=4, n_test=2)
    classes = ("red_thing", "green_thing", "blue_thing")  # labels: sorted folder names
    label = {c: i for i, c in enumerate(sorted(classes))}
    listed = [(f"/home/authors/mine/train/{c}/{i}.png", label[c]) for c in classes for i in (3, 1)]
    write_jsonl(jsonl_path(folder, 2, 1, "train"), listed)
    seen = {}
    real = coop.train.runner.setup

    def recording(cfg, *args, **kwargs):
        s = real(cfg, *args, **kwargs)
        seen["train"] = [(d.path, d.label) for d in s.dataset.train]
        return s

    monkeypatch.setattr(coop.train.runner, "setup", recording)
    args = tiny_args(
        folder, tmp_path / "run", **{"data.shots": 2, "data.fewshot_source": "jsonl", "train.epochs": 2}
    )
    res = run_tool_in_process(REPO / "tools" / "train.py", args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert seen["train"] == [(str(folder / p.split("/mine/")[1]), y) for p, y in listed]
    # evaluating the run reads all of the dataset's images, not the split files
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    res = run_tool_in_process(
        REPO / "tools" / "eval.py", ["--checkpoint", tmp_path / "run" / "checkpoint.pt"]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    again = json.loads((tmp_path / "run" / "eval_imagefolder.json").read_text())
    assert again["accuracy"] == metrics["accuracy"] and again["n_test"] == 6
    # an entry that does not resolve: one line, and no run folder
    write_jsonl(jsonl_path(folder, 2, 1, "train"), [*listed, ("/home/authors/mine/train/red_thing/7.png", 2)])
    out = tmp_path / "run2"
    res = run_tool_in_process(
        REPO / "tools" / "train.py",
        tiny_args(folder, out, **{"data.shots": 2, "data.fewshot_source": "jsonl"}),
    )
    assert res.returncode != 0 and res.stderr.strip().splitlines() == [
        f"error: data.fewshot_source=jsonl: {jsonl_path(folder, 2, 1, 'train')} line 7: "
        f"/home/authors/mine/train/red_thing/7.png is no image of imagefolder's train split under {folder}"
    ], res.stderr[-2000:]
    assert not out.exists()
    res = run_tool_in_process(
        REPO / "tools" / "train.py",
        tiny_args(folder, out, **{"data.shots": 0, "data.fewshot_source": "jsonl"}),
    )
    assert "set data.shots to their K" in res.stderr and not out.exists()


def test_the_data_doctor_checks_the_files(tmp_path):
    data = tmp_path / "DATA"
    dtd(data)
    assert check_dataset("dtd", data).usable  # no split files: nothing to check
    write_jsonl(jsonl_path(data / "dtd", 2, 1, "train"), TRAIN)
    write_jsonl(jsonl_path(data / "dtd", 2, 1, "val"), VAL)
    write_jsonl(jsonl_path(data / "dtd", 1, 2, "train"), TRAIN[:1])
    (data / "dtd" / "split_fewshot" / "notes.jsonl").write_text("not a split file")
    assert check_dataset("dtd", data).usable
    bad = "/home/authors/data/dtd/images/dotted/val_7.jpg"
    write_jsonl(jsonl_path(data / "dtd", 2, 1, "val"), [VAL[0], (bad, 1)])
    write_jsonl(jsonl_path(data / "dtd", 1, 2, "train"), [(TRAIN[0][0], 1)])
    report = check_dataset("dtd", data)
    assert not report.usable
    assert [p for p, _ in report.errors] == [
        f"data.fewshot_source=jsonl: {jsonl_path(data / 'dtd', 1, 2, 'train')} line 1: {TRAIN[0][0]} has "
        f"_label 1, but dtd labels {data / 'dtd/images/banded/train_3.jpg'} 0",
        f"data.fewshot_source=jsonl: {jsonl_path(data / 'dtd', 2, 1, 'val')} line 2: {bad} is no image of "
        f"dtd's val split under {data / 'dtd/images'}",
    ]
    assert "scripts/download_splits.sh" in report.errors[0][1]


def test_config_key():
    cfg = load_config(None, ["data.name=dtd", "data.fewshot_source=jsonl"])
    assert run_name(cfg) == "dtd/ViT-B-16/shots16/nctx4_cscfalse_posend_depth1_jsonl/seed1"
    assert run_name(load_config(None, ["data.name=dtd"])).endswith("_depth1/seed1")
    with pytest.raises(ConfigError, match="data.fewshot_source=jsonl reads 2SFS's K-shot split files"):
        load_config(None, ["data.fewshot_source=jsonl", "data.shots=0"])
    with pytest.raises(ConfigError, match="data.fewshot_source"):
        load_config(None, ["data.fewshot_source=pickle"])
