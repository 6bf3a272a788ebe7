"""TensorBoard events of a training run, read back with TensorBoard's own event reader."""

from __future__ import annotations

import csv
import json
import logging
import sys

import pytest
from conftest import make_image_folder, tiny_args

from coop.config.load import load_config
from coop.train.runner import train_run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_events_repeat_history_and_metrics(tmp_path):
    data = make_image_folder(tmp_path / "data", n_train=4, n_test=2)
    out = tmp_path / "run"
    # base-to-new: the run also evaluates the new classes (eval_imagefolder_new.json)
    cfg = load_config(None, tiny_args(data, out, **{"data.subsample_classes": "base", "train.epochs": 3}))
    assert cfg.train.tensorboard is True  # on by default
    metrics = train_run(cfg)
    scalars = read_scalars(out)
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    for tag, column in (("train/loss", "loss"), ("train/accuracy", "train_acc"), ("train/lr", "lr")):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3]
        assert [v for _, v in scalars[tag]] == pytest.approx([float(r[column]) for r in rows], rel=1e-6)
    assert scalars["test/accuracy"] == [(3, pytest.approx(metrics["accuracy"], rel=1e-6))]
    assert scalars["test/macro_f1"] == [(3, pytest.approx(metrics["macro_f1"], rel=1e-6))]
    new = json.loads((out / "eval_imagefolder_new.json").read_text())
    assert scalars["test_imagefolder_new/accuracy"] == [(3, pytest.approx(new["accuracy"], rel=1e-6))]
    # a finished run is not repeated and writes no further points
    train_run(
        load_config(None, tiny_args(data, out, **{"data.subsample_classes": "base", "train.epochs": 3}))
    )
    assert read_scalars(out) == scalars and len(list((out / "tb").iterdir())) == 1  # no new event file


def test_off_without_tensorboard_or_when_disabled(tmp_path, monkeypatch, caplog):
    data = make_image_folder(tmp_path / "data", n_train=2, n_test=1)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails: not installed
    with caplog.at_level(logging.INFO, logger="coop.train.tensorboard"):
        train_run(load_config(None, tiny_args(data, tmp_path / "a", **{"train.epochs": 2, "data.shots": 2})))
    off = [r.getMessage() for r in caplog.records if r.name == "coop.train.tensorboard"]
    assert len(off) == 1 and "TensorBoard is off" in off[0] and "not installed" in off[0]
    assert (tmp_path / "a" / "metrics.json").is_file() and not (tmp_path / "a" / "tb").exists()
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    extra = {"train.epochs": 2, "data.shots": 2, "train.tensorboard": "false"}
    train_run(load_config(None, tiny_args(data, tmp_path / "b", **extra)))
    assert not (tmp_path / "b" / "tb").exists()
