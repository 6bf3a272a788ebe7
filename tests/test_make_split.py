"""Custom datasets: tools/make_split.py writes CoOp split files that `imagefolder` reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter

import pytest
from conftest import REPO, run_tool_in_process, tiny_args
from PIL import Image

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data import DataError, build_dataset
from coop.data.splits import make_split
from coop.train.runner import train_run

TOOL = [sys.executable, str(REPO / "tools" / "make_split.py")]
COLOURS = {"red_thing": (200, 40, 40), "green_thing": (40, 200, 40), "blue_thing": (40, 40, 200)}


def class_folder(root, sizes: dict[str, int]):
    """`root/<class>/<i>.png`, coloured per class so a prompt can learn them."""
    for name, n in sizes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (16, 16), COLOURS.get(name, (90, 90, 90))).save(root / name / f"{i:02d}.png")
    return root


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_split_is_stratified_deterministic_and_read_back(tmp_path):
    folder = class_folder(tmp_path / "set", {"red_thing": 10, "green_thing": 7, "blue_thing": 4})
    (folder / "split_fewshot").mkdir()  # a few-shot cache folder is not a class
    out = tmp_path / "split.json"
    res = run(folder, "--out", out, "--val", 0.2, "--test", 0.3, "--seed", 1)
    assert res.returncode == 0, res.stderr
    assert "3 classes, 11 train, 4 val, 6 test" in res.stdout
    split = json.loads(out.read_text())
    labels = {"blue_thing": 0, "green_thing": 1, "red_thing": 2}  # sorted folder names
    # per class: round(n * 0.3) test, round(n * 0.2) val (at least 1), the rest train
    expected = {"red_thing": (5, 2, 3), "green_thing": (4, 1, 2), "blue_thing": (2, 1, 1)}
    for name, sizes in expected.items():
        got = tuple(sum(1 for it in split[s] if it[2] == name) for s in ("train", "val", "test"))
        assert got == sizes, name
    every = [tuple(it) for s in ("train", "val", "test") for it in split[s]]
    assert len(set(every)) == 21  # a partition of the images
    for path, label, name in every:
        assert (folder / path).is_file() and labels[name] == label and path.startswith(f"{name}/")
    assert not list(folder.glob("*.json"))  # nothing written into FOLDER

    assert make_split(folder, 0.2, 0.3, seed=1) == split  # deterministic in the seed
    other = make_split(folder, 0.2, 0.3, seed=2)
    assert other != split and Counter(it[2] for it in other["test"]) == Counter(it[2] for it in split["test"])

    ds = build_dataset("imagefolder", folder, split_file=out)
    assert ds.classnames == ["blue_thing", "green_thing", "red_thing"]
    for s in ("train", "val", "test"):
        got = [[os.path.abspath(folder / it[0]), it[1], it[2]] for it in split[s]]
        assert [[d.path, d.label, d.classname] for d in getattr(ds, s)] == got


def test_fewshot_cache_records_the_split_file(tmp_path, caplog):
    folder = class_folder(tmp_path / "set", {"red_thing": 10, "green_thing": 10})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(make_split(folder, 0.2, 0.3, seed=1)))
    b.write_text(json.dumps(make_split(folder, 0.2, 0.3, seed=2)))
    ds_a = build_dataset("imagefolder", folder, shots=2, seed=1, split_file=a)
    ds_b = build_dataset("imagefolder", folder, shots=2, seed=1, split_file=b)
    cache_a, cache_b = (
        tmp_path / "split_fewshot" / "shot_2-seed_1-a.json",
        tmp_path / "split_fewshot" / "shot_2-seed_1-b.json",
    )
    assert json.loads(cache_a.read_text())["split_file"] == str(a.resolve())
    assert json.loads(cache_b.read_text())["split_file"] == str(b.resolve())
    train_a = {d.path for d in build_dataset("imagefolder", folder, split_file=a).train}
    assert {d.path for d in ds_a.train} <= train_a
    assert {d.path for d in ds_b.train} <= {
        d.path for d in build_dataset("imagefolder", folder, split_file=b).train
    }
    # the split changes under the same name: the cache is resampled from the new train split
    a.write_text(json.dumps(make_split(folder, 0.2, 0.3, seed=3)))
    new_train = {d.path for d in build_dataset("imagefolder", folder, split_file=a).train}
    with caplog.at_level(logging.WARNING, logger="coop.data.fewshot"):
        again = build_dataset("imagefolder", folder, shots=2, seed=1, split_file=a)
    assert "is stale" in caplog.text
    assert {d.path for d in again.train} <= new_train
    assert not list(folder.rglob("*.json"))  # caches go beside the split file, not into FOLDER


def test_bad_class_is_one_line(tmp_path):
    folder = class_folder(tmp_path / "set", {"red_thing": 5, "green_thing": 2})
    # in-process, log lines included (the tool's real process: the test above)
    res = run_tool_in_process(
        REPO / "tools" / "make_split.py", [folder, "--out", tmp_path / "s.json"], log=True
    )
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "class 'green_thing' has 2 image(s), too few for val=0.2 test=0.3" in res.stderr
    assert not (tmp_path / "s.json").exists()
    assert make_split(folder, val=0, test=0.3)["val"] == []  # no val split: 2 images suffice
    (folder / "blue_thing").mkdir()
    with pytest.raises(DataError, match="class 'blue_thing' has no images"):
        make_split(folder, val=0, test=0.3)
    with pytest.raises(DataError, match="val \\+ test < 1"):
        make_split(folder, val=0.5, test=0.5)


def test_base_to_new_through_a_split_file(tmp_path):
    folder = class_folder(tmp_path / "set", {"red_thing": 6, "green_thing": 6, "blue_thing": 6})
    split = tmp_path / "split.json"
    assert make_split(folder, val=0.34, test=0.34)  # 2 train, 2 val, 2 test images per class
    split.write_text(json.dumps(make_split(folder, val=0.34, test=0.34)))
    out = tmp_path / "run"
    extra = {
        "data.split_file": str(split),
        "data.subsample_classes": "base",
        "data.shots": 2,
        "train.epochs": 2,
    }
    metrics = train_run(load_config(None, tiny_args(folder, out, **extra)))
    new = json.loads((out / "eval_imagefolder_new.json").read_text())
    assert metrics["n_test"] == 4 and new["n_test"] == 2  # base: 2 classes x 2 test images; new: 1 x 2
    assert len(metrics["per_class_accuracy"]) == 2 and len(new["per_class_accuracy"]) == 1
    with pytest.raises(ConfigError, match="data.split_file=null"):
        load_config(None, ["data.name=dtd", f"data.split_file={split}"])
