"""Research tools on a tiny model: sweeps, result tables, figures, prompt words, attention maps."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pandas as pd
import pytest
import torch
from conftest import (
    REPO,
    TINY_CONFIG,
    build_openclip,
    make_image_folder,
    randomise_prompts,
    run_tool_in_process,
)
from omegaconf import OmegaConf

import coop
from coop.config.load import load_config, to_yaml
from coop.config.run_names import run_name
from coop.model.tokenizer import TokenizerError
from coop.model.weights import resolve_model_name
from coop.results import attention_maps, nearest_words
from coop.results.tables import load_runs, summarize, varying_keys
from coop.train import grid as grid_lib
from coop.train import sweep as sweep_lib
from coop.train.checkpoint import save_checkpoint

TOOLS = REPO / "tools"
GRIDS = REPO / "configs" / "ablations"
CLASSES = ["dog", "golden_retriever", "St. Bernard", "a very long compound class name"]

FAKE_TRAIN = '''
"""Stand-in for tools/train.py: writes config.yaml and metrics.json; train.lr=0.666 fails if $FAIL."""
import json, os, sys
from pathlib import Path
import yaml
cfg = {}
for arg in sys.argv[1:]:
    key, _, value = arg.partition("=")
    node = cfg
    *head, last = key.split(".")
    for h in head:
        node = node.setdefault(h, {})
    node[last] = yaml.safe_load(value)
out = Path(cfg["output_dir"])
(out / "config.yaml").write_text(yaml.safe_dump(cfg))
print("fake training", out)
if cfg["train"]["lr"] == 0.666 and os.environ.get("FAIL"):
    sys.exit("error: loss is NaN")
(out / "metrics.json").write_text(json.dumps({"accuracy": 50.0 + cfg["data"]["seed"], "n_test": 8}))
'''


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"coop_tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_tool(name, *args, env=None):
    cmd = [sys.executable, str(TOOLS / f"{name}.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env or os.environ.copy())


def sweep_here(*args):
    """tools/sweep.py in this process, log lines included (its real process: the submitit test); the
    runs it starts are processes of their own either way."""
    return run_tool_in_process(TOOLS / "sweep.py", list(args), log=True)


def tiny_keys(data):
    return [f"model.name={TINY_CONFIG}", "model.pretrained=none", "data.name=imagefolder",
            f"data.root={data}", "data.shots=4", "data.num_workers=0", "train.epochs=2",
            "train.aug_views=1", "train.batch_size=4", "device=cpu"]  # fmt: skip


# ---------------------------------------------------------------- sweeps (real tools/train.py)


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    return {**os.environ, "COOP_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "coop-cache")}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"), ("red_thing", "green_thing"), 4, 4)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_data, cache_env):
    """Two positions x two seeds of the tiny model, two runs at a time (the sweep in this process, its
    runs in their own, which share the features cache)."""
    root = tmp_path_factory.mktemp("sweep")
    grid = root / "grid.yaml"
    grid.write_text("\n".join(k.replace("=", ": ", 1) for k in tiny_keys(tiny_data)) + "\n")
    grid.write_text(grid.read_text() + "prompt.position: [end, middle]\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COOP_CACHE_DIR", cache_env["COOP_CACHE_DIR"])
        res = sweep_here("--grid", grid, "--out", root / "runs", "--jobs", 2, "data.seed=[1,2]")
    return root, grid, res


def test_sweep_runs_every_point(swept):
    root, _, res = swept
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted((root / "runs").rglob("metrics.json"))
    assert len(runs) == 4
    for path in runs:
        cfg = load_config(str(path.parent / "config.yaml"))
        assert path.parent == root / "runs" / run_name(cfg)  # CoOp-style folder names
        assert (path.parent / "sweep.log").is_file() and (path.parent / "checkpoint.pt").is_file()
    assert {p.parent.parent.name for p in runs} == {
        "nctx4_cscfalse_posend_depth1",
        "nctx4_cscfalse_posmiddle_depth1",
    }


def test_collect_table_matches_metrics(swept):
    root, _, _ = swept
    res = run_tool_in_process(TOOLS / "collect.py", [root / "runs"])  # a real subprocess: test_protocols
    assert res.returncode == 0, res.stderr
    table = pd.read_csv(root / "runs" / "results.csv")
    assert list(table["prompt.position"]) == ["end", "middle"]
    assert list(table["n_seeds"]) == [2, 2]
    for _, row in table.iterrows():
        folder = (
            root / "runs" / f"imagefolder/coop-tiny/shots4/nctx4_cscfalse_pos{row['prompt.position']}_depth1"
        )
        accs = [json.loads((folder / f"seed{s}" / "metrics.json").read_text())["accuracy"] for s in (1, 2)]
        assert row["accuracy_mean"] == pytest.approx(statistics.mean(accs))
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
    assert "| prompt.position | n_seeds | accuracy |" in (root / "runs" / "results.md").read_text()
    assert "| end | 2 |" in res.stdout


def test_second_sweep_skips_finished_runs(swept, capsys):
    root, grid, _ = swept
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").rglob("checkpoint.pt")}
    res = sweep_here("--grid", grid, "--out", root / "runs", "data.seed=[1,2]")
    assert res.returncode == 0 and "4 done" in res.stderr and "nothing to do" in res.stderr
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").rglob("checkpoint.pt")}
    dry = load_tool("sweep").main(
        ["--grid", str(grid), "--out", str(root / "runs"), "--dry-run", "data.seed=[1,2,3]"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert dry == 0 and len(lines) == 7
    assert sum(ln.startswith("done") for ln in lines) == 4 and sum(ln.startswith("new") for ln in lines) == 2
    assert lines[-1] == "6 runs: 4 done, 0 to resume, 2 new"


def test_sweep_through_submitit_local_executor(tmp_path, tiny_data, cache_env):
    pytest.importorskip("submitit")
    out = tmp_path / "runs"
    args = ["--out", out, "--executor", "local", *tiny_keys(tiny_data), "prompt.depth=2"]
    res = run_tool("sweep", *args, env=cache_env)
    assert res.returncode == 0, res.stderr[-3000:]
    (metrics,) = out.rglob("metrics.json")
    assert metrics.parent.parent.name == "nctx4_cscfalse_posend_depth2"
    assert json.loads(metrics.read_text())["n_test"] == 8
    assert list((out / ".submitit").glob("*_result.pkl"))


# ---------------------------------------------------------------- sweep mechanics (fake trainer)


def test_sweep_reports_failures_and_resumes(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    args = ["--out", tmp_path / "runs", "--train-script", fake, "--jobs", 2, "data.name=textile"]
    args += ["model.pretrained=none"]  # the model must be buildable here, though the fake trainer builds none
    args += ["train.lr=[0.002,0.666]", "data.seed=[1,2]"]
    monkeypatch.setenv("FAIL", "1")  # the fake trainer fails at train.lr=0.666
    res = sweep_here(*args)
    monkeypatch.delenv("FAIL")
    assert res.returncode == 1
    failed = [ln for ln in res.stderr.splitlines() if ln.startswith("  ")]
    assert len(failed) == 2 and all("_lr0.666/seed" in ln and "loss is NaN" in ln for ln in failed)
    assert len(list((tmp_path / "runs").rglob("metrics.json"))) == 2  # the others still ran
    assert load_tool("sweep").main([*map(str, args), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 runs: 2 done, 2 to resume, 0 new"
    again = sweep_here(*args)  # the failed runs are rerun, the finished ones skipped
    assert again.returncode == 0 and "2 of 2 runs finished" in again.stderr
    assert len(list((tmp_path / "runs").rglob("metrics.json"))) == 4


def test_sweep_rejects_bad_points_before_running(tmp_path):
    out = tmp_path / "runs"
    res = sweep_here("--grid", GRIDS / "position.yaml", "--out", out, "prompt.colour=[red,blue]")
    assert res.returncode == 2 and "'prompt.colour'" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()
    sweep = load_tool("sweep")
    with pytest.raises(ValueError, match="data.root is not set"):  # dtd reads a DATA folder
        sweep.main(["--grid", str(GRIDS / "position.yaml"), "--out", str(out)])
    with pytest.raises(ValueError, match="unknown data.name 'imagenette'"):
        sweep.main(["--out", str(out), "data.name=imagenette", "--dry-run"])
    with pytest.raises(FileNotFoundError, match="grid file not found"):
        sweep.main(["--grid", str(tmp_path / "missing.yaml"), "--out", str(out)])
    assert not out.exists()


def test_run_folders_and_shipped_grids(tmp_path):
    counts = {"position": 30, "depth": 18, "n_ctx": 15, "csc": 30}
    for name, n in counts.items():
        grid = grid_lib.load_grid(str(GRIDS / f"{name}.yaml"), ["data.name=textile"])
        runs = sweep_lib.plan(grid, tmp_path)
        assert len(runs) == n and len({r.folder for r in runs}) == n
        assert all(r.folder.parts[-5:-3] == ("textile", "ViT-B-16") for r in runs)
    # swept keys missing from the run name are appended; values survive the command line
    grid = grid_lib.load_grid(None, ["data.name=textile", "train.lr=[0.1,0.02]", "prompt.ctx_init='a: b'"])
    names = [r.folder.parent.name for r in sweep_lib.plan(grid, tmp_path)]
    assert names == ["nctxinit_cscfalse_posend_depth1_lr0.1", "nctxinit_cscfalse_posend_depth1_lr0.02"]
    assert load_config(None, sweep_lib.plan(grid, tmp_path)[0].overrides).prompt.ctx_init == "a: b"
    with pytest.raises(ValueError, match="same run folder"):
        sweep_lib.plan(
            grid_lib.load_grid(None, ["data.name=textile", "prompt.position=[mid,middle]"]), tmp_path
        )


# ---------------------------------------------------------------- tables and figures (synthetic)


def fake_runs(root, settings, seeds=(1, 2, 3), incomplete=()):
    """Run folders with config.yaml + metrics.json; accuracy = 50 + 2*shots + seed (+3 for end)."""
    expected = {}
    for over in [*settings, *incomplete]:
        for seed in seeds:
            cfg = load_config(None, [*over, f"data.seed={seed}", "data.name=textile"])
            folder = root / run_name(cfg)
            folder.mkdir(parents=True)
            cfg.output_dir = str(folder)
            (folder / "config.yaml").write_text(to_yaml(cfg))
            if over in incomplete:
                continue
            acc = 50 + 2 * cfg.data.shots + seed + 3 * (cfg.prompt.position == "end") - cfg.prompt.depth
            (folder / "metrics.json").write_text(json.dumps({"accuracy": acc, "macro_f1": acc - 1}))
            expected.setdefault(tuple(over), []).append(acc)
    return expected


def test_collect_groups_varying_keys_and_lists_incomplete(tmp_path):
    settings = [[f"prompt.position={p}", f"data.shots={k}"] for p in ("end", "middle") for k in (1, 4)]
    expected = fake_runs(tmp_path, settings, incomplete=[["prompt.depth=3"]])
    runs = load_runs(tmp_path)
    assert len(runs) == 15 and (~runs["complete"]).sum() == 3
    assert varying_keys(runs) == ["data.shots", "prompt.position"]
    assert load_tool("collect").main([str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "results.csv")
    assert len(table) == 4 and list(table["n_seeds"]) == [3] * 4
    for _, row in table.iterrows():
        accs = expected[(f"prompt.position={row['prompt.position']}", f"data.shots={row['data.shots']}")]
        assert row["accuracy_mean"] == pytest.approx(statistics.mean(accs))
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
    text = (tmp_path / "results.md").read_text()
    assert "Incomplete runs" in text and text.count("depth3/seed") == 3
    assert summarize(runs, ["prompt.position"])["n_runs"].tolist() == [6, 6]
    with pytest.raises(ValueError, match="unknown grouping key 'prompt.colour'"):
        summarize(runs, ["prompt.colour"])


def test_plot_writes_only_figures_with_data(tmp_path, capsys):
    settings = [[f"prompt.position={p}", f"data.shots={k}"] for p in ("end", "middle") for k in (1, 2, 4, 16)]
    settings += [["prompt.position=end", "data.shots=16", f"prompt.depth={j}"] for j in (2, 4)]
    fake_runs(tmp_path / "all", settings, seeds=(1, 2))
    assert load_tool("plot").main([str(tmp_path / "all")]) == 0
    for name in ("acc_vs_shots.png", "acc_vs_depth.png", "end_vs_middle.png"):
        path = tmp_path / "all" / name
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000, name
    fake_runs(tmp_path / "one", [["data.shots=4"]])
    assert load_tool("plot").main([str(tmp_path / "one")]) == 1
    assert "skipped" in capsys.readouterr().out and not list((tmp_path / "one").glob("*.png"))


# ---------------------------------------------------------------- inside the prompts


def random_learner(clip, classes=CLASSES, seed=0, **kw):
    return randomise_prompts(coop.PromptLearner(clip, classes, **kw), seed)


@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("csc,depth", [(False, 1), (True, 1), (False, 3), (True, 2)])
def test_attention_weights_path_matches_encoder(tiny_clip, position, csc, depth):
    """The explicit-softmax path (need_weights) gives the same features as the SDPA path."""
    learner = random_learner(tiny_clip, n_ctx=4, position=position, csc=csc, depth=depth)
    with torch.no_grad():
        ref = coop.PromptClassifier(tiny_clip, learner).text_features()
    feats, attn, pooled = attention_maps.attention_maps(tiny_clip.text, learner)
    assert float((feats - ref).abs().max() / ref.abs().max()) < 1e-5
    n_layers, length = len(tiny_clip.text.blocks), int(learner.eos.max()) + 1
    assert attn.shape == (n_layers, len(CLASSES), length, length)
    assert torch.equal(pooled, learner.eos)  # CLIP's tower: the feature is read at [EOS]


def test_attention_module_weights_are_causal_probabilities(tiny_clip):
    block = tiny_clip.text.blocks[1]
    x = torch.randn(3, 7, tiny_clip.width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = block.attn(x)
        slow, weights = block.attn(x, need_weights=True)
        out, block_weights = block(x, need_weights=True)
        expected = block.attn(block.ln_1(x), need_weights=True)[1]  # the block asks its own module
    assert weights.shape == (3, block.attn.heads, 7, 7)
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-6)  # each query's row sums to 1
    assert weights.triu(1).abs().max() == 0  # causal: no query sees a later key
    assert weights[..., torch.ones(7, 7).tril().bool()].min() > 0  # ... and every earlier key some
    assert torch.allclose(slow, fast, atol=1e-6) and torch.equal(block_weights, expected)
    assert torch.allclose(out, block(x), atol=1e-6)


def test_attention_roles_follow_the_causal_mask(tiny_clip):
    learner = random_learner(tiny_clip, n_ctx=4, position="end")
    layouts = attention_maps.layout_learners(
        tiny_clip, learner, ["dog", "golden_retriever"], ["end", "middle", "front"]
    )
    mass = {}
    for pos, lrn in layouts.items():
        assert torch.equal(lrn.ctx, learner.ctx)
        _, attn, pooled = attention_maps.attention_maps(tiny_clip.text, lrn)
        mass[pos] = attention_maps.attention_to_roles(
            attn, attention_maps.token_roles(lrn, tiny_clip.tokenizer, pooled)
        )
    assert mass["end"]["ctx->cls"].abs().max() == 0 and mass["middle"]["ctx->cls"].min() > 0
    assert mass["front"]["cls->ctx"].abs().max() == 0 and mass["end"]["cls->ctx"].min() > 0
    roles = attention_maps.token_roles(layouts["middle"], tiny_clip.tokenizer, layouts["middle"].eos)[1]
    assert roles["labels"] == ["[SOS]", "v1", "v2", "golden", "retriever", "v3", "v4", ".", "[EOS]"]
    csc = random_learner(tiny_clip, n_ctx=2, csc=True)
    with pytest.raises(ValueError, match="not in the checkpoint's classes"):
        attention_maps.layout_learners(tiny_clip, csc, ["cat"], ["end"])


def test_coca_attention_is_read_at_its_class_token(tmp_path):
    """CoCa pools a class token appended after the text: the maps' pooled row is that token's,
    which sees the text through the token after [EOS] (open_clip's mask, one place right)."""
    path = REPO / "configs" / "models" / "coca-tiny.json"
    name = resolve_model_name(str(path))
    clip = coop.CLIP.from_openclip(build_openclip(name), name=name)
    learner = random_learner(clip, n_ctx=4, position="middle", depth=2)
    with torch.no_grad():
        ref = coop.PromptClassifier(clip, learner).text_features()
    feats, attn, pooled = attention_maps.attention_maps(clip.text, learner)
    assert float((feats - ref).abs().max() / ref.abs().max()) < 1e-5
    size = attn.shape[-1]
    assert size == int(learner.eos.max()) + 3  # through the token after [EOS], then the class token
    assert torch.equal(pooled, torch.full_like(learner.eos, size - 1))
    rows = torch.arange(len(CLASSES))
    after = attn[:, rows, pooled, learner.eos + 1]  # (layers, n_cls): the token after [EOS]
    assert after.min() > 0 and attn[:, rows, learner.eos, learner.eos + 1].abs().max() == 0
    seen = attention_maps.visible(clip.text, learner.eos, size)
    assert torch.equal(attn > 0, seen.expand_as(attn))  # exactly the keys the mask shows
    roles = attention_maps.token_roles(learner, clip.tokenizer, pooled)
    assert all(r["labels"][-1] == "[cls_emb]" and r["keys"][-1] == size - 1 for r in roles)
    mass = attention_maps.attention_to_roles(attn, roles)
    expected = torch.stack([attn[:, c, size - 1, r["ctx"]].sum(-1) for c, r in enumerate(roles)]).mean(0)
    assert torch.allclose(mass["pooled->ctx"], expected)
    written, data = attention_maps.attention_figures(clip, learner, ["dog"], ["middle"], tmp_path)
    tokens = data["positions"]["middle"]["classes"]["dog"]["tokens"]
    matrix = data["positions"]["middle"]["classes"]["dog"]["attention"]
    assert tokens[-2:] == ["[EOS]", "[cls_emb]"] and len(matrix[0]) == len(tokens) == len(matrix[0][0])


def test_nearest_words_recover_planted_words(tiny_clip):
    words = ["photo", "texture", "bird"]
    ids = [tiny_clip.tokenizer.encode(w)[0] for w in words]
    table = tiny_clip.text.token_embedding.weight
    learner = random_learner(tiny_clip, n_ctx=3, csc=True, depth=3)
    with torch.no_grad():
        learner.ctx[1] = table[ids]  # class 1, input layer
    rows = nearest_words.nearest_words(learner, table, tiny_clip.tokenizer, topk=2)
    assert len(rows) == 3 * len(CLASSES) * 3 * 2 * 2  # layers x classes x slots x metrics x k
    for metric in nearest_words.METRICS:
        top = [r for r in rows if r["layer"] == 0 and r["class"] == "golden retriever" and r["rank"] == 1]
        assert [r["word"] for r in top if r["metric"] == metric] == words
    assert {r["layer"] for r in rows} == {0, 1, 2}
    assert "golden retriever" in nearest_words.format_words_table(rows)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A finished tiny run: middle layout, shared context, depth 2, saved like train.py does."""
    clip = coop.load_clip(str(TINY_CONFIG))
    learner = random_learner(
        clip, ["red_thing", "green_thing", "blue_thing"], n_ctx=4, position="middle", depth=2
    )
    over = [f"model.name={TINY_CONFIG}", "model.pretrained=none", "prompt.position=middle", "prompt.depth=2"]
    path = tmp_path / "run" / "checkpoint.pt"
    save_checkpoint(
        path,
        {"prompt": {k: v.detach() for k, v in learner.prompt_tensors().items()},
         "config": OmegaConf.to_container(load_config(None, over)),
         "classnames": ["red_thing", "green_thing", "blue_thing"], "n_ctx": 4, "epoch": 1, "finished": True},
    )  # fmt: skip
    return path


def test_interpret_prompt_tool(tiny_checkpoint):
    res = run_tool("interpret_prompt", tiny_checkpoint, "--topk", 3)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "(shared)" in res.stdout and "euclidean" in res.stdout
    data = json.loads((tiny_checkpoint.parent / "prompt_words.json").read_text())
    assert data["depth"] == 2 and len(data["words"]) == 2 * 4 * 2 * 3  # layers x slots x metrics x k
    csv = pd.read_csv(tiny_checkpoint.parent / "prompt_words.csv")
    assert set(csv.columns) >= {"layer", "class", "slot", "metric", "rank", "word", "score"}
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_tool("interpret_prompt").main([str(tiny_checkpoint.parent / "missing.pt")])
    # --tokenizer reaches the model (refused here: coop-tiny uses CLIP's BPE, which needs none)
    with pytest.raises(
        TokenizerError, match=f"model.tokenizer={tiny_checkpoint.parent}: model coop-tiny uses"
    ):
        load_tool("interpret_prompt").main([str(tiny_checkpoint), "--tokenizer", str(tiny_checkpoint.parent)])


def test_attention_tool(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "attn"
    assert (
        load_tool("attention").main(
            [str(tiny_checkpoint), "--classes", "red_thing", "blue thing", "--out", str(out)]
        )
        == 0
    )
    assert "layouts drawn: end, middle" in capsys.readouterr().out
    for name in ("attention_red_thing.png", "attention_blue_thing.png", "attention_roles.png"):
        assert (out / name).stat().st_size > 10_000, name
    data = json.loads((out / "attention.json").read_text())
    assert data["trained_position"] == "middle" and set(data["positions"]) == {"end", "middle"}
    matrix = data["positions"]["end"]["classes"]["red thing"]["attention"]
    assert len(matrix) == 3 and len(matrix[0]) == len(
        data["positions"]["end"]["classes"]["red thing"]["tokens"]
    )
