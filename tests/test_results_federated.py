"""Tables and figures of federated runs, from hand-written run folders (no Flower needed).

A run folder as coop/federated/server.py leaves it: config.yaml (with its `fl` section),
metrics.json (train.py's fields plus a nested `fl` dict, `per_domain_accuracy`, ...) and
history.csv (one row per round).
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys

import pandas as pd
import pytest
import yaml
from conftest import REPO
from omegaconf import OmegaConf

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.results.plots import load_histories, round_keys, round_table, rounds_figure
from coop.results.tables import domain_table, load_runs

ROUNDS = (1, 2, 3, 4)


def tool(name: str):
    spec = importlib.util.spec_from_file_location(f"coop_tool_{name}_fl", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def round_acc(seed: int, depth: int, domain: str, rnd: int) -> float:
    """A history's accuracy: differs by seed, setting and target domain, and grows per round."""
    return 40.0 + 3 * seed + depth + 5 * len(domain) + 2 * rnd


def write_fl_run(folder, overrides, accs: list[float], history: bool = True, finished: bool = True):
    """config.yaml, history.csv (rounds `ROUNDS`, accuracy `accs`) and metrics.json (the last round)."""
    cfg = OmegaConf.to_container(load_config(None, [*overrides, f"fl.rounds={len(accs)}"]))
    cfg["output_dir"] = str(folder)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    if history:
        rows = "".join(f"{r},{a},{a - 1},{1 / r:.4f},3\n" for r, a in zip(ROUNDS, accs, strict=True))
        (folder / "history.csv").write_text("round,accuracy,macro_f1,train_loss,clients\n" + rows)
    if finished:
        domain = cfg["data"]["target_domain"]
        metrics = {
            "accuracy": accs[-1],
            "macro_f1": accs[-1] - 1,
            "per_class_accuracy": [50.0, None],
            "n_test": 20,
            "method": cfg["fl"]["method"],
            "rounds": len(accs),
            "fl": cfg["fl"],
            "target_domain": domain,
            "per_domain_accuracy": {domain: accs[-1]} if domain else {"a": 1.0, "b": 2.0},
            "client_failures": [{"round": 2, "client": 1, "error": "DataError: x"}],
            "domain_usage": {"0": 12, "1": 3},
            "bytes_sent": 1024,
        }
        (folder / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture
def lodo(tmp_path):
    """Leave-one-domain-out latent-domain runs: 3 target domains x depth 1/9 x seeds 1, 2; depth 9
    never ran on `sketch` (an incomplete row), and one unfinished run."""
    root = tmp_path / "lodo"
    for domain in ("art", "photo", "sketch"):
        for depth in (1, 9):
            if depth == 9 and domain == "sketch":
                continue
            for seed in (1, 2):
                over = ["data.name=multidomain", f"data.target_domain={domain}", f"prompt.depth={depth}",
                        f"data.seed={seed}", "fl.method=latent_domains", "fl.partition=dirichlet"]  # fmt: skip
                accs = [round_acc(seed, depth, domain, r) for r in ROUNDS]
                write_fl_run(root / domain / f"depth{depth}" / f"seed{seed}", over, accs)
    over = ["data.name=multidomain", "data.target_domain=sketch", "prompt.depth=9", "data.seed=3"]
    write_fl_run(root / "sketch" / "depth9" / "seed3", over, [1.0, 2.0, 3.0, 4.0], finished=False)
    return root


def test_round_table_is_the_mean_over_seeds_per_round(lodo):
    runs = load_runs(lodo)
    histories = load_histories(runs, lodo)
    assert len(histories) == 10 * len(ROUNDS)  # the unfinished run is left out
    assert round_keys(histories) == (["data.name", "data.target_domain"], ["prompt.depth"])
    table = round_table(histories)
    assert len(table) == 5 * len(ROUNDS) and set(table["n_seeds"]) == {2}
    for _, row in table.iterrows():
        accs = [round_acc(s, row["prompt.depth"], row["data.target_domain"], row["round"]) for s in (1, 2)]
        assert row["accuracy_mean"] == pytest.approx(statistics.mean(accs))
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
    loss = round_table(histories, "train_loss", ddof=0)
    assert loss.loc[loss["round"] == 2, "train_loss_mean"].tolist() == pytest.approx([0.5] * 5)
    assert (loss["train_loss_std"] == 0).all()


def test_plot_writes_acc_vs_round(lodo, capsys):
    assert tool("plot").main([str(lodo)]) == 0
    out = capsys.readouterr().out
    path = lodo / "acc_vs_round.png"
    assert f"wrote   {path}" in out
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000


def test_no_round_figure_without_rounds(tmp_path):
    """Centralised runs log epochs; without the root the histories cannot be found either."""
    folder = tmp_path / "central" / "seed1"
    write_fl_run(folder, ["data.seed=1"], [50.0, 51.0, 52.0, 53.0], history=False)
    (folder / "history.csv").write_text("epoch,accuracy\n1,50\n2,53\n")
    runs = load_runs(tmp_path / "central")
    assert not len(load_histories(runs, tmp_path / "central"))
    assert rounds_figure(runs, root=tmp_path / "central") is None
    assert rounds_figure(runs) is None


def test_domains_table_averages_complete_rows_only(lodo):
    assert tool("collect").main([str(lodo), "--table", "domains"]) == 0
    table = pd.read_csv(lodo / "results_domains.csv")
    assert list(table["method"]) == ["latent_domains"] * 2 and list(table["prompt.depth"]) == [1, 9]
    last = ROUNDS[-1]
    for _, row in table.iterrows():
        depth = row["prompt.depth"]
        domains = ("art", "photo", "sketch") if depth == 1 else ("art", "photo")
        means = []
        for d in domains:
            accs = [round_acc(s, depth, d, last) for s in (1, 2)]
            assert row[f"{d}_mean"] == pytest.approx(statistics.mean(accs))
            assert row[f"{d}_std"] == pytest.approx(statistics.stdev(accs))
            assert row[f"{d}_n"] == 2
            means.append(statistics.mean(accs))
        if depth == 1:
            assert row["average"] == pytest.approx(statistics.mean(means))
        else:
            assert math.isnan(row["sketch_mean"]) and math.isnan(row["average"])
    text = (lodo / "results_domains.md").read_text()
    assert "| method | art | photo | sketch | **Average** |" in text
    assert "latent_domains (depth=9)" in text and "| – | – |" in text
    assert "Incomplete runs" in text and "sketch/depth9/seed3" in text


def test_domains_table_needs_target_domains(tmp_path):
    write_fl_run(tmp_path / "iid" / "seed1", ["fl.partition=iid"], [50.0, 51.0, 52.0, 53.0])
    with pytest.raises(ConfigError, match="data.target_domain"):
        domain_table(load_runs(tmp_path))


def test_settings_table_on_federated_runs(tmp_path, capsys):
    """Nested `fl`, per-domain and failure entries of metrics.json do not reach the table."""
    settings = [["fl.partition=iid"], ["fl.partition=dirichlet", "fl.alpha=0.1"],
                ["fl.partition=dirichlet", "fl.alpha=0.5"]]  # fmt: skip
    expected = {}
    for i, over in enumerate(settings):
        for seed in (1, 2, 3):
            acc = 60.0 + 4 * i + seed
            write_fl_run(
                tmp_path / f"s{i}" / f"seed{seed}", [*over, f"data.seed={seed}"], [acc - 3, 0, 0, acc]
            )
            expected.setdefault(i, []).append(acc)
    assert tool("collect").main([str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "results.csv")
    assert list(table.columns[:2]) == ["fl.alpha", "fl.partition"] and "fl" not in table.columns
    assert list(table["n_seeds"]) == [3, 3, 3]
    by_setting = {(r["fl.partition"], r["fl.alpha"]): r for _, r in table.iterrows()}
    for i, key in enumerate([("iid", 0.5), ("dirichlet", 0.1), ("dirichlet", 0.5)]):
        assert by_setting[key]["accuracy_mean"] == pytest.approx(statistics.mean(expected[i]))
        assert by_setting[key]["accuracy_std"] == pytest.approx(statistics.stdev(expected[i]))
    assert (load_runs(tmp_path)["method"] == "promptfl").all()
