"""The test-time pass (coop.tta.runner, tools/tta.py) and ZERO (coop.tta.zero) on a tiny CLIP.

ZERO's outputs are checked against a written-out computation per image (views -> CLIP's logits ->
the 30% of views with the lowest entropy -> majority vote), on zero-shot CLIP and on a trained
CoOp run; the refusals come before the run folder exists; a pass killed with SIGKILL and rerun
ends bit-identical to an uninterrupted one (ZERO, episodic, and TDA, online); two ranks equal one
process (ZERO and TPT); tta.views null takes the method's original's views for the dataset; TPT
runs through tools/tta.py from a CoOp run; ZERO, TPT and TDA run on SigLIP, EVA02 and PE-Core.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TINY_CONFIG,
    make_image_folder,
    run_tool_in_process,
    shrunk_timm,
    small_timm_config,
    tiny_args,
)
from omegaconf import OmegaConf
from torchvision import transforms as T

import coop.tta
import coop.tta.zero
from coop.config.checks import ConfigError
from coop.data import build_dataset
from coop.data.images import derive_seed, load_image
from coop.model.weights import load_clip
from coop.train.engine import clip_transforms
from coop.tta import TTA_METHODS, TestTimeError, TestTimeMethod, outputs
from coop.tta.host import tta_config
from coop.tta.runner import tta_run
from coop.tta.zero import vote

ZERO, TPT, TDA = (REPO / "configs" / "tta" / f"{m}.yaml" for m in ("zero", "tpt", "tda"))
VIEWS = 8


def zero_args(folder, out, **extra) -> list[str]:
    args = {"tta.views": VIEWS, "tta.chunk": 5, **extra}
    picked = {
        k: v for k, v in dict(a.split("=", 1) for a in tiny_args(folder, out)).items() if k != "data.shots"
    }
    return [
        f"{k}={v}" for k, v in {**picked, **args}.items() if k not in ("train.epochs", "train.batch_size")
    ]


def run(folder, out, path=ZERO, **extra) -> dict:
    return tta_run(tta_config(str(path), zero_args(folder, out, **extra)))


# ---------------------------------------------------------------- ZERO's vote on hand-made logits


def test_the_confident_views_vote_and_the_winner_is_the_majority():
    # 10 views, gamma 0.3: the 3 with the lowest entropy (rows 0, 2, 4: sharp) vote 1, 1, 2
    logits = torch.zeros(10, 4)
    logits[0, 1] = logits[2, 1] = logits[4, 2] = 20.0
    logits[[1, 3, 5, 6, 7, 8, 9], 3] = 1.0  # flat rows: they do not vote, however many
    out = vote(logits, 0.3)
    assert out.argmax() == 1
    torch.testing.assert_close(out.softmax(-1)[:3], torch.tensor([0.0, 2 / 3, 1 / 3]))


def test_a_tie_goes_to_the_first_left_out_view_that_picks_a_tied_class():
    logits = torch.zeros(10, 4)
    logits[0, 1] = logits[1, 2] = 30.0  # the two most confident views: a 1-1 tie between 1 and 2
    logits[2, 3] = 29.0  # kept too (3 views): class 3 has one vote as well: a three-way tie
    logits[3, 0] = 5.0  # first left out: picks 0, not tied
    logits[4, 2] = 4.0  # second left out: picks 2, tied -> 2 wins, with one vote more
    for r in range(5, 10):
        logits[r, 1] = 1.0
    out = vote(logits, 0.3)
    assert out.argmax() == 2
    torch.testing.assert_close(out.softmax(-1), torch.tensor([0.0, 0.25, 0.5, 0.25]))


def test_a_tie_no_left_out_view_settles_goes_to_the_highest_tied_logit_of_the_first():
    logits = torch.full((4, 4), -5.0)
    logits[0, 1] = logits[1, 2] = 30.0  # gamma 0.5 keeps 2: a tie between 1 and 2
    logits[2] = torch.tensor([3.0, 1.0, 2.0, -5.0])  # left out: argmax 0, not tied; of 1, 2: 2
    logits[3] = torch.tensor([3.0, 2.5, 1.0, -5.0])
    assert vote(logits, 0.5).argmax() == 2
    logits[[0, 1]] = logits[[1, 0]]  # which kept view is which changes nothing
    assert vote(logits, 0.5).argmax() == 2


def test_one_view_keeps_the_view_and_every_view_may_vote():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert vote(logits, 0.3).argmax() == 1  # int(1 * 0.3) = 0, and the selection keeps one
    two = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 5.0]])
    assert vote(two, 1.0).argmax() == 1  # all kept, a 1-1 tie: the most confident view decides


# ---------------------------------------------------------------- ZERO through the pass, written out


def written_out_zero(folder, views: int, gamma: float, seed: int, logits_of, test) -> torch.Tensor:
    """ZERO's votes per image (N, n_cls) from scratch: the views (test transform; crops and flips
    seeded by (seed, i, j)), their logits, the int(views * gamma) of lowest entropy, their argmax
    counts, and one more vote for the winner of a tie (the first view left out that picks a tied
    class). Their argmax is ZERO's prediction."""
    ds = build_dataset("imagefolder", str(folder), shots=0)
    size = test.transforms[1].size
    crop = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *test.transforms[-2:]])
    votes = []
    for i, item in enumerate(ds.test):
        img = load_image(item.path)
        stack = [test(img)]
        for j in range(1, views):
            torch.manual_seed(derive_seed(seed, i, j))
            stack.append(crop(img))
        logits = logits_of(torch.stack(stack))
        p = logits.softmax(-1)
        ent = -(p * p.log()).sum(-1)
        ranked = sorted(range(views), key=lambda v: (float(ent[v]), v))
        keep, rest = ranked[: max(1, int(views * gamma))], ranked[max(1, int(views * gamma)) :]
        counts = torch.bincount(logits[keep].argmax(-1), minlength=logits.shape[1]).float()
        tied = [c for c in range(len(counts)) if counts[c] == counts.max()]
        if len(tied) > 1:
            picks = [int(logits[v].argmax()) for v in rest if int(logits[v].argmax()) in tied]
            counts[picks[0] if picks else max(tied, key=lambda c: (float(logits[rest[0], c]), -c))] += 1
        votes.append(counts)
    return torch.stack(votes)


class ZeroShotLogits:
    """CLIP's logits of views for "a photo of a {class}.", from its two towers."""

    def __init__(self, folder, model=TINY_CONFIG, tokenizer=None):
        self.clip = load_clip(str(model), "none", torch.device("cpu"), tokenizer).float().eval()
        self.transform = clip_transforms(self.clip)[1]
        names = build_dataset("imagefolder", str(folder), shots=0).classnames
        with torch.no_grad():
            text = self.clip.encode_text(
                self.clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in names])
            )
        self.text = text / text.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def __call__(self, views):
        img = self.clip.encode_image(views)
        return self.clip.logit_scale.exp() * (img / img.norm(dim=-1, keepdim=True)) @ self.text.T


def test_zero_on_zero_shot_clip_is_the_written_out_vote(image_folder, tmp_path):
    metrics = run(image_folder, tmp_path / "run")
    out = outputs.read_outputs(tmp_path / "run")
    assert sorted(os.listdir(tmp_path / "run")) == [
        ".lock", "config.yaml", "log.txt", "metrics.json", "outputs.safetensors"
    ]  # fmt: skip
    clip = ZeroShotLogits(image_folder)
    expected = written_out_zero(image_folder, VIEWS, 0.3, 1, clip, clip.transform).argmax(-1)
    assert torch.equal(out["index"], torch.arange(12)) and torch.equal(
        out["labels"], torch.arange(3).repeat_interleave(4)
    )
    assert torch.equal(out["logits"].argmax(-1), expected)
    shares = out["logits"].softmax(-1)  # the vote shares of int(8 * 0.3) = 2 views (+1 breaking a tie)
    assert all(
        round(float(s) * 2) == float(s) * 2 or round(float(s) * 3) == pytest.approx(float(s) * 3)
        for s in shares.flatten()
    )
    torch.testing.assert_close(shares.sum(-1), torch.ones(12))
    assert metrics["accuracy"] == pytest.approx(100 * float((expected == out["labels"]).double().mean()))
    assert (
        metrics["kind"] == "episodic" and metrics["augment"] == "crop_flip" and metrics["zero_gamma"] == 0.3
    )
    assert {"top5", "ece", "macro_f1", "per_class_accuracy"} <= set(metrics)


class ColourHost(torch.nn.Module):
    """A pixel host whose logits are 10 x a view's mean per channel: its views disagree where an image
    has two colours, and their entropies differ, so the selection decides the vote."""

    input, name, n_cls, classnames = "pixels", "colour", 3, ["red", "green", "blue"]
    clip = type("Clip", (), {"logit_scale": torch.zeros(())})()

    def prepare(self):
        return None

    def logits(self, views, prepared=None):
        return 10 * views.float().mean((2, 3))


def two_colour_folder(root: Path) -> Path:
    from PIL import Image

    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        pixels = torch.randint(0, 256, (32, 32, 3), generator=gen, dtype=torch.uint8)
        pixels[:, : 8 + 3 * i, 0] = 255  # a red band of growing width on the left, random elsewhere
        for split in ("train", "test"):  # the reader wants a train split too
            (root / split / "red").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.numpy()).save(root / split / "red" / f"{i}.png")
    return root


def test_zero_votes_with_the_confident_views_of_the_pass(tmp_path, monkeypatch):
    """On a host whose views disagree, the pass's outputs are the written-out log vote shares."""
    import coop.tta.runner
    from coop.tta.host import Host

    folder = two_colour_folder(tmp_path / "images")
    host = Host(
        ColourHost(), clip_transforms(load_clip(str(TINY_CONFIG), "none", torch.device("cpu")))[1], "fp32"
    )
    monkeypatch.setattr(coop.tta.runner, "build_host", lambda cfg, names, device: host)
    run(folder, tmp_path / "run", **{"tta.views": 16})
    got = outputs.read_outputs(tmp_path / "run")["logits"]
    votes = written_out_zero(folder, 16, 0.3, 1, host.method.logits, host.transform)
    first = votes.max(-1).values
    assert 0 < (first < 4).sum() < 6  # split votes: the selection decides
    expected = (votes / votes.sum(-1, keepdim=True)).clamp_min(torch.finfo(torch.float32).tiny).log()
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "tower, size",
    [("siglip-tiny", 64), ("eva02-tiny", 56), pytest.param("pe-core-tiny", 64, marks=pytest.mark.slow)],
)
def test_zero_tpt_and_tda_on_other_towers(tmp_path, tower, size, monkeypatch):
    """SigLIP (its own tokenizer, made offline), EVA02 and PE-Core (timm image towers, here 2 blocks
    at 4x4 patches: 3 images, 4 views): ZERO is the same vote over their logits; TPT's and TDA's
    passes are their methods applied to the runner's views in stream order (TDA: the image alone,
    its views on an image folder; its caches carried along)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    image_folder = make_image_folder(tmp_path / "images", n_train=1, n_test=1)
    model, extra = small_timm_config(REPO / "configs" / "models" / f"{tower}.json", tmp_path, size), {}
    with shrunk_timm(depth=2, img_size=size):  # open_clip names no depth or size for timm
        if tower == "siglip-tiny":
            pytest.importorskip("transformers")
            from coop.model.tiny_tokenizers import make_tiny_tokenizer

            make_tiny_tokenizer(model, tmp_path / "tok")
            extra["model.tokenizer"] = tmp_path / "tok"
        run(image_folder, tmp_path / "run", **{"model.name": model, "tta.views": 4, **extra})
        clip = ZeroShotLogits(image_folder, model, extra.get("model.tokenizer"))
        expected = written_out_zero(image_folder, 4, 0.3, 1, clip, clip.transform).argmax(-1)
        assert torch.equal(outputs.read_outputs(tmp_path / "run")["logits"].argmax(-1), expected)
        for path, views, replayed in ((TPT, 4, 2), (TDA, "null", 3)):
            args = zero_args(
                image_folder, tmp_path / path.stem, **{"model.name": model, "tta.views": views, **extra}
            )
            cfg = tta_config(str(path), args)
            metrics = tta_run(cfg)
            assert metrics["views"] == (4 if path == TPT else 1) and metrics["tta_method"] == path.stem
            replay_pass(cfg, outputs.read_outputs(tmp_path / path.stem), replayed)


def replay_pass(cfg, out: dict, n: int) -> None:
    """The first `n` outputs of a pass (in stream order) are its method's `predict` on the views
    the runner makes, one fresh method applied to the images in that order."""
    from coop.tta.host import build_host
    from coop.tta.runner import views_of
    from coop.tta.views import ViewMaker, augment_for

    items = build_dataset(cfg.data.name, cfg.data.root, shots=0).test
    host = build_host(
        cfg, build_dataset(cfg.data.name, cfg.data.root, shots=0).classnames, torch.device("cpu")
    )
    method = coop.tta.build_tta(host.method, cfg)
    maker = ViewMaker(host.transform, views_of(cfg, method), augment_for(method.augment, cfg.data.name), 1)
    assert torch.isfinite(out["logits"]).all() and len(out["logits"]) == len(items)
    for row, i in enumerate(out["index"][:n].tolist()):
        expected = method.predict(maker(load_image(items[i].path), i), i).detach().float()
        torch.testing.assert_close(out["logits"][row], expected, rtol=1e-5, atol=1e-5)


def test_zero_on_a_maple_run_scores_the_views_through_its_prompted_tower(image_folder, tmp_path):
    from coop.config.load import load_config
    from coop.interop import load_classifier
    from coop.train.runner import train_run

    maple = {
        "method": "maple",
        "prompt.depth": 2,
        "vision.depth": 2,
        "train.epochs": 1,
        "train.warmup_epochs": 0,
    }
    train_run(load_config(None, tiny_args(image_folder, tmp_path / "maple", **maple)))
    metrics = run(image_folder, tmp_path / "tta", **{"tta.init": tmp_path / "maple"})
    clf = load_classifier(tmp_path / "maple")
    assert clf.method.input == "pixels"
    expected = written_out_zero(image_folder, VIEWS, 0.3, 1, clf.logits, clf.transform).argmax(-1)
    assert torch.equal(outputs.read_outputs(tmp_path / "tta")["logits"].argmax(-1), expected)
    assert metrics["method"] == "maple"


@pytest.fixture(scope="module")
def coop_run(image_folder, tmp_path_factory) -> Path:
    """A CoOp run of one epoch on the image folder, and its export beside it (coop.safetensors)."""
    from coop.config.load import load_config
    from coop.interop import export_run
    from coop.train.runner import train_run

    out = tmp_path_factory.mktemp("tta-host") / "coop"
    train_run(
        load_config(None, tiny_args(image_folder, out, **{"train.epochs": 1, "train.warmup_epochs": 0}))
    )
    export_run(out, out.with_suffix(".safetensors"))
    return out


def test_zero_on_a_trained_coop_run_and_its_export(image_folder, coop_run, tmp_path):
    """The host of tta.init is the run's method (its learned context), from the folder or its export,
    with the run's model; data.* are the pass's own."""
    from coop.interop import load_classifier

    clf = load_classifier(coop_run)
    expected = written_out_zero(image_folder, VIEWS, 0.3, 2, clf.logits, clf.transform).argmax(-1)
    for init in (coop_run, coop_run.with_suffix(".safetensors")):
        metrics = run(image_folder, tmp_path / f"tta-{init.name}", **{"tta.init": init, "data.seed": 2})
        out = outputs.read_outputs(tmp_path / f"tta-{init.name}")
        assert torch.equal(out["logits"].argmax(-1), expected), init
        assert metrics["method"] == "coop" and metrics["init"] == str(init)
    a, b = (outputs.read_outputs(tmp_path / f"tta-{i}") for i in ("coop", "coop.safetensors"))
    assert torch.equal(a["logits"], b["logits"])


# ---------------------------------------------------------------- TPT and the online methods' views


def test_tpt_through_the_tool_from_a_coop_run(image_folder, coop_run, tmp_path):
    """tools/tta.py --config configs/tta/tpt.yaml tta.init=RUN: each image's logits are TPT's step on
    the run's learned context, from the views the runner makes for that image (seed, image)."""
    from coop.interop import load_classifier

    args = zero_args(image_folder, tmp_path / "tpt", **{"tta.views": 4, "tta.init": coop_run})
    result = run_tool_in_process(REPO / "tools" / "tta.py", ["--config", TPT, *args])
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "tpt" / "metrics.json").read_text())
    assert (metrics["tta_method"], metrics["method"], metrics["views"]) == ("tpt", "coop", 4)
    assert metrics["augment"] == "augmix"  # TPT's rule off the ImageNet sets
    out = outputs.read_outputs(tmp_path / "tpt")
    assert torch.equal(out["index"], torch.arange(12))
    replay_pass(tta_config(str(TPT), args), out, 4)
    clf = load_classifier(coop_run)  # the run's own logits of the images: TPT moved them
    untuned = torch.cat([clf.logits(clf.transform(load_image(item.path))[None]) for item in
                         build_dataset("imagefolder", str(image_folder), shots=0).test])  # fmt: skip
    assert not torch.allclose(out["logits"], untuned, rtol=1e-5, atol=1e-5)


def test_null_views_take_the_originals_number_for_the_dataset(image_folder, tmp_path):
    """configs/tta/tda.yaml leaves tta.views null: the image alone on an image folder (ImageNet's row)
    and the cross-dataset sets, 64 AugMix views on ImageNet-A (an imagenet_a fixture); tta.views=4
    overrides it; the folder name says _views-own. DPE and BoostAdapter answer per dataset too."""
    from coop.config.run_names import tta_run_name
    from coop.data.imagenet_variants import IMAGENET_VARIANTS
    from coop.tta.runner import views_of

    own = tta_config(str(TDA), zero_args(image_folder, tmp_path / "own", **{"tta.views": "null"}))
    assert own.tta.views is None and "/tta_tda/zeroshot" in tta_run_name(own)
    assert tta_run_name(own).endswith("_views-own/seed1")
    metrics = tta_run(own)
    assert (metrics["views"], metrics["augment"]) == (1, None)
    four = tta_config(str(TDA), zero_args(image_folder, tmp_path / "four", **{"tta.views": 4}))
    assert tta_run_name(four).endswith("_views4/seed1")
    assert (tta_run(four)["views"], outputs.read_outputs(tmp_path / "four")["logits"].shape) == (4, (12, 3))

    layout = IMAGENET_VARIANTS["imagenet_a"]
    images = tmp_path / "data" / layout.folder
    images.mkdir(parents=True)
    (images / "classnames.txt").write_text("n01 goldfish\nn02 great white shark\nn03 tench\n")
    for wnid, colour in (("n01", "red_thing"), ("n02", "blue_thing")):
        (images / layout.images / wnid).mkdir(parents=True)
        (images / layout.images / wnid / "0.png").write_bytes(
            (image_folder / "test" / colour / "0.png").read_bytes()
        )
    shifted = {"data.name": "imagenet_a", "data.root": tmp_path / "data", "tta.views": "null"}
    metrics = tta_run(tta_config(str(TDA), zero_args(image_folder, tmp_path / "a", **shifted)))
    assert (metrics["views"], metrics["augment"], metrics["n_test"]) == (64, "augmix", 2)
    expected = {"tda": (1, 1, 1, 64, 64), "dpe": (64, 1, 64, 64, 64), "boostadapter": (1, 64, 1, 64, 64)}
    for name, views in expected.items():
        cfgs = [tta_config(str(REPO / "configs" / "tta" / f"{name}.yaml"), [f"data.name={d}"])
                for d in ("imagefolder", "dtd", "imagenet", "imagenet_a", "imagenet_sketch")]  # fmt: skip
        assert all(c.tta.views is None for c in cfgs), name
        assert tuple(views_of(c, TTA_METHODS[name]) for c in cfgs) == views, name


# ---------------------------------------------------------------- refusals, before the run folder


def refusal(image_folder, tmp_path, *extra, path=ZERO) -> str:
    with pytest.raises((TestTimeError, ConfigError)) as e:
        tta_run(tta_config(str(path), [*zero_args(image_folder, tmp_path / "out"), *extra]))
    assert not (tmp_path / "out").exists()
    return str(e.value)


def test_refusals_name_the_key_before_the_folder_exists(image_folder, tmp_path, monkeypatch):
    bad = tmp_path / "notes.txt"
    bad.write_text("x")
    assert refusal(image_folder, tmp_path, f"tta.init={bad}") == (
        f"tta.init={bad} is neither a run folder (with checkpoint.pt) nor an export (.safetensors from tools/export.py)"
    )
    assert "tta.init is not set, and method=coop" in refusal(image_folder, tmp_path, "method=coop")
    assert refusal(image_folder, tmp_path, "tta.views=0").startswith("tta.views must be an integer >= 1")
    assert refusal(image_folder, tmp_path, "zero.gamma=0").startswith("zero.gamma must be a number in (0, 1]")
    assert refusal(image_folder, tmp_path, "tta.method=nope").startswith(
        "tta.method must be one of tpt, ctpt, zero"
    )

    class Picky(TestTimeMethod):
        name = "zero"

        @classmethod
        def check_host(cls, host):
            raise TestTimeError(f"tta.method=zero cannot start from method={host.name}")

    monkeypatch.setitem(TTA_METHODS, "zero", Picky)
    assert refusal(image_folder, tmp_path) == "tta.method=zero cannot start from method=zeroshot"


def test_an_init_of_another_model_or_method_is_refused(image_folder, coop_run, tmp_path):
    run_dir = coop_run
    other = REPO / "configs" / "models" / "eva02-tiny.json"
    message = refusal(image_folder, tmp_path, f"tta.init={run_dir}", f"model.name={other}")
    assert message.startswith(f"model.name={other} disagrees with tta.init={run_dir}, a run of model.name=")
    message = refusal(image_folder, tmp_path, f"tta.init={run_dir}", "method=zeroshot")
    assert message.startswith("method=zeroshot disagrees with tta.init=")
    assert tta_config(str(ZERO), [f"tta.init={run_dir}", f"model.name={TINY_CONFIG}"]).method == "coop"


def test_an_online_method_refuses_more_than_one_rank(image_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert refusal(image_folder, tmp_path, "tta.method=tda") == (
        "tta.method=tda is online: its state follows one stream of images, which 2 ranks cannot share; "
        "run it in one process"
    )


def test_the_tool_says_it_in_one_line(image_folder, tmp_path):
    result = run_tool_in_process(
        REPO / "tools" / "tta.py",
        ["--config", ZERO, *zero_args(image_folder, tmp_path / "out"), "tta.init=nowhere"],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: tta.init=nowhere is neither a run folder (with checkpoint.pt) nor an export "
        "(.safetensors from tools/export.py)"
    ]


# ---------------------------------------------------------------- SIGKILL and resume


def killed_at(kill_at: int, args: list[str], also=None, path=ZERO) -> int:
    """Run the pass of config `path` in a forked child that SIGKILLs itself at its `kill_at`-th predict
    call (or where `also` patches in a kill); returns the child's exit code."""

    def child():
        method = TTA_METHODS[OmegaConf.select(tta_config(str(path), args), "tta.method")]
        calls = [0]
        real = method.predict

        def predict(self, views, index):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, views, index)

        method.predict = predict
        if also is not None:
            also()
        tta_run(tta_config(str(path), args))

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join()
    return proc.exitcode


def same_folder(a: Path, b: Path) -> None:
    assert (a / "outputs.safetensors").read_bytes() == (b / "outputs.safetensors").read_bytes()
    assert json.loads((a / "metrics.json").read_text()) == json.loads((b / "metrics.json").read_text())
    rank_logs = {"log.rank1.txt"}  # a torchrun rank k > 0 logs its warnings there
    assert sorted(set(os.listdir(a)) - rank_logs) == sorted(set(os.listdir(b)) - rank_logs)


def test_zero_killed_and_rerun_ends_bit_identical(image_folder, tmp_path):
    run(image_folder, tmp_path / "whole")
    args = zero_args(image_folder, tmp_path / "killed")
    assert killed_at(8, args) == -signal.SIGKILL  # in the second chunk: 5 images written
    assert [c[:2] for c in outputs.chunks(tmp_path / "killed")] == [(0, 5)]
    calls = []
    real = coop.tta.zero.Zero.predict
    coop.tta.zero.Zero.predict = lambda self, v, i: calls.append(i) or real(self, v, i)
    try:
        tta_run(tta_config(str(ZERO), args))
    finally:
        coop.tta.zero.Zero.predict = real
    assert calls == list(range(5, 12))  # after the last image written
    same_folder(tmp_path / "whole", tmp_path / "killed")


def test_tda_killed_and_rerun_ends_bit_identical(image_folder, tmp_path):
    """TDA's caches are saved with the stream position after every chunk: a kill mid-chunk, or
    between a chunk and its state (the chunk is dropped and redone), then a rerun, ends as one pass."""
    tda = {"tta.views": 4}  # AugMix views: the confident views' mean feature is the cache key
    run(image_folder, tmp_path / "whole", TDA, **tda)
    whole = outputs.read_outputs(tmp_path / "whole")
    order = outputs.stream_order(12, True, 1)
    assert torch.equal(whole["index"], order) and not torch.equal(order, torch.arange(12))
    args = zero_args(image_folder, tmp_path / "killed", **tda)
    assert killed_at(7, args, path=TDA) == -signal.SIGKILL
    position, state = outputs.load_state(tmp_path / "killed")
    assert position == 5 and 0 < int(state["pos.count"].sum()) <= 5  # the caches so far

    def kill_on_second_state():
        saved = outputs.save_state

        def save(folder, position, state):
            if position == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            saved(folder, position, state)

        outputs.save_state = save

    assert killed_at(0, args, also=kill_on_second_state, path=TDA) == -signal.SIGKILL
    assert [c[:2] for c in outputs.chunks(tmp_path / "killed")] == [(0, 5), (5, 10)]
    tta_run(tta_config(str(TDA), args))
    same_folder(tmp_path / "whole", tmp_path / "killed")
    assert json.loads((tmp_path / "whole" / "metrics.json").read_text())["order_seed"] == 1


# ---------------------------------------------------------------- ranks


def _rank(rank: int, port: int, args: list[str], path: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from coop import distributed

    try:
        tta_run(tta_config(str(path), args))
    finally:
        distributed.close()


@pytest.mark.parametrize("path, extra", [(ZERO, {}), (TPT, {"tta.views": 4})], ids=["zero", "tpt"])
def test_two_ranks_share_the_images_and_equal_one_process(image_folder, tmp_path, path, extra):
    import torch.multiprocessing as mp
    from test_distributed import free_port

    run(image_folder, tmp_path / "one", path, **extra)
    args = zero_args(image_folder, tmp_path / "two", **extra)  # chunks of 5: shares of 3 and 2
    mp.start_processes(_rank, args=(free_port(), args, path), nprocs=2, join=True, start_method="fork")
    same_folder(tmp_path / "one", tmp_path / "two")


def test_an_unreadable_image_is_skipped_or_named_and_a_changed_config_is_refused(tmp_path):
    from coop.data import DataError
    from coop.train.runner import RunError

    folder = make_image_folder(tmp_path / "images", n_train=1, n_test=2)
    (folder / "test" / "green_thing" / "1.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="cannot read image .*1.png"):
        run(folder, tmp_path / "named")
    metrics = run(folder, tmp_path / "skipped", **{"data.skip_corrupt": "true"})
    assert (metrics["n_test"], metrics["n_skipped"]) == (5, 1)
    assert outputs.read_outputs(tmp_path / "skipped")["index"].tolist() == [0, 1, 2, 4, 5]
    assert run(folder, tmp_path / "skipped", **{"data.skip_corrupt": "true"}) == metrics  # finished: as is
    with pytest.raises(RunError, match="tta.views: 8 there, 4 now"):
        run(folder, tmp_path / "skipped", **{"data.skip_corrupt": "true", "tta.views": 4})
