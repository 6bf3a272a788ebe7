"""What a reader sees in the figures of `coop.results.plots`, measured with the renderer's bounding boxes.

Synthetic run folders (config.yaml + metrics.json, history.csv for federated runs) whose seeds
spread so widely that mean + std passes 100%, with long setting labels and several panels.
"""

from __future__ import annotations

import itertools
import json

import matplotlib
import pytest
from test_results_federated import write_fl_run

from coop.config.load import load_config, to_yaml
from coop.config.run_names import run_name
from coop.results.plots import lines_figure, positions_figure, rounds_figure
from coop.results.tables import load_runs

matplotlib.use("Agg")
SPREAD = {1: 99.5, 2: 80.0}  # accuracy per seed: mean 89.75, std 13.8, so mean + std > 100


def fake_runs(root, settings, accuracy=lambda cfg: SPREAD[cfg.data.seed], seeds=(1, 2)):
    for over, seed in itertools.product(settings, seeds):
        cfg = load_config(None, [*over, f"data.seed={seed}"])
        folder = root / run_name(cfg)
        folder.mkdir(parents=True)
        cfg.output_dir = str(folder)
        (folder / "config.yaml").write_text(to_yaml(cfg))
        (folder / "metrics.json").write_text(json.dumps({"accuracy": accuracy(cfg), "macro_f1": 50.0}))
    return load_runs(root)


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """Three datasets x end/middle x csc x shots 1 and 16, and depth 2 and 9 at 16 shots (60 run
    folders, read by two tests: built once)."""
    datasets = ("caltech101", "eurosat", "oxford_pets")
    settings = [[f"data.name={d}", f"prompt.position={p}", f"prompt.csc={c}", f"data.shots={k}"]
                for d in datasets for p in ("end", "middle") for c in ("false", "true") for k in (1, 16)]  # fmt: skip
    settings += [[f"data.name={d}", "data.shots=16", f"prompt.depth={j}"] for d in datasets for j in (2, 9)]
    return fake_runs(tmp_path_factory.mktemp("ablation"), settings)


def boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    return renderer, axes


def assert_readable(fig):
    """The title inside the figure and clear of the axes; the legend outside every axes (their
    tick and axis labels included) and inside the figure; no two x tick labels overlapping."""
    renderer, axes = boxes(fig)
    title = fig._suptitle.get_window_extent(renderer)
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1, "title cut off"
    for ax in axes:
        assert not title.overlaps(ax.get_tightbbox(renderer)), "title over an axes"
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0, "legend cut off"
        for ax in axes:
            assert not box.overlaps(ax.get_tightbbox(renderer)), "legend over an axes"
    assert all(ax.get_legend() is None for ax in axes)  # one legend, the figure's
    for ax in axes:
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        for a, b in itertools.combinations(ticks, 2):
            assert not a.overlaps(b), "x tick labels overlap"


def colours_by_label(fig) -> dict[str, set]:
    """{label: colours it is drawn in} over every panel (lines, and error-bar lines by container)."""
    out = {}
    for ax in fig.axes:
        drawn = [(c.get_label(), c.lines[0]) for c in ax.containers if hasattr(c, "has_yerr")]
        drawn += [(line.get_label(), line) for line in ax.get_lines()]
        for label, line in drawn:
            if not label.startswith("_"):
                out.setdefault(label, set()).add(matplotlib.colors.to_hex(line.get_color()))
    return out


def test_lines_figure_caps_percentages_and_keeps_the_legend_outside(ablation):
    fig = lines_figure(ablation, "data.shots")
    assert [ax.get_title() for ax in fig.axes] == [
        f"dataset={d}" for d in ("caltech101", "eurosat", "oxford_pets")
    ]
    assert all(ax.get_ylim()[1] <= 100 for ax in fig.axes)
    assert max(max(line.get_ydata()) for ax in fig.axes for line in ax.get_lines()) > 100  # the error bars
    assert_readable(fig)
    # one colour per setting in every panel; depth=1 is shared by every line: named once, in the title
    colours = colours_by_label(fig)
    assert set(colours) == {f"position={p}, csc={c}" for p in ("end", "middle") for c in (False, True)}
    assert all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == 4
    assert "(depth=1)" in fig._suptitle.get_text()
    assert fig.axes[0].get_xlabel() == "shots per class (data.shots, log scale)"
    assert fig.axes[0].get_ylabel() == "accuracy (%)"

    depth = lines_figure(ablation, "prompt.depth")
    assert all(ax.get_ylim()[1] <= 100 for ax in depth.axes) and not depth.legends  # one line per panel
    assert "shots=16" in depth._suptitle.get_text() and "position=end" in depth._suptitle.get_text()
    assert_readable(depth)


def test_a_metric_that_is_no_percentage_keeps_its_axis(tmp_path):
    runs = fake_runs(tmp_path, [["data.shots=1"], ["data.shots=4"]])
    runs["seconds"] = 150.0 + runs["data.seed"].astype(float)
    fig = lines_figure(runs, "data.shots", "seconds")
    assert fig.axes[0].get_ylim()[1] > 150 and fig.axes[0].get_ylabel() == "seconds"


def test_positions_figure_title_legend_and_labels_fit(ablation, tmp_path):
    """Six groups with two-line labels; and the single-group figure whose title used to be cut off."""
    fig = positions_figure(ablation)
    ax = fig.axes[0]
    assert ax.get_ylim() == (0, 100)
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == [
        "dataset=caltech101\ncsc=False",
        "dataset=caltech101\ncsc=True",
    ]
    assert "depth=1, shots=16" in fig._suptitle.get_text()  # shared by every group
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["end", "middle"]
    assert_readable(fig)

    one = fake_runs(
        tmp_path / "one", [["data.name=oxford_pets", f"prompt.position={p}"] for p in ("end", "middle")]
    )
    fig = positions_figure(one)
    assert fig.axes[0].get_ylim()[1] <= 100 and "dataset=oxford_pets" in fig._suptitle.get_text()
    assert_readable(fig)


def test_rounds_figure_caps_bands_and_shares_colours(tmp_path):
    for domain, depth, seed in itertools.product(
        ("art_painting", "photo", "sketch", "cartoon", "clipart"), (1, 9), (1, 2)
    ):
        over = ["data.name=multidomain", f"data.target_domain={domain}", f"prompt.depth={depth}", f"data.seed={seed}",
                "fl.method=latent_domains", "fl.partition=dirichlet"]  # fmt: skip
        accs = [70.0, 90.0, 99.0, 100.0] if seed == 1 else [60.0, 80.0, 90.0, 92.0]  # bands past 100
        write_fl_run(tmp_path / domain / f"depth{depth}" / f"seed{seed}", over, accs)
    runs = load_runs(tmp_path)
    fig = rounds_figure(runs, root=tmp_path)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 5 and all(ax.get_ylim()[1] <= 100 for ax in visible)
    colours = colours_by_label(fig)
    assert set(colours) == {"depth=1", "depth=9"} and all(len(c) == 1 for c in colours.values())
    assert visible[0].get_xlabel() == "communication round"
    assert_readable(fig)
    loss = rounds_figure(runs, "train_loss", root=tmp_path)
    assert loss.axes[0].get_ylabel() == "train_loss" and loss.axes[0].get_ylim()[1] < 2
