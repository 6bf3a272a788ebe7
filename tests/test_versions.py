"""The dependencies whose private internals coop reads are held to pyproject.toml's tested ranges
(`coop.versions`): each use degrades in one line naming the package and the range under a release
outside it (the version lookup faked), and is untouched inside it."""

from __future__ import annotations

import logging
import sys
import tomllib

from conftest import REPO
from packaging.requirements import Requirement

from coop import versions  # its functions by the module's name: pytest would collect `tested_*`
from coop.versions import installed, untested

PRIVATES = ("timm", "open_clip_torch", "flwr")  # the packages whose internals coop reads


def faking(monkeypatch, dist: str, version: str) -> None:
    """`dist` reads as installed at `version`; every other package at its real one."""
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda d: version if d == dist else real(d))


def test_the_tested_ranges_are_pyprojects_and_admit_this_environment():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stated = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    assert (
        versions.tested_range("timm") == stated["timm"]
        and versions.tested_range("open-clip-torch") == stated["open_clip_torch"]
    )
    flwr = [r for extra in project["optional-dependencies"].values() for r in extra if r.startswith("flwr[")]
    assert [versions.tested_range("flwr")] == [Requirement(r).specifier for r in flwr]
    for dist in (*PRIVATES, "torch", "torchvision"):
        assert versions.tested_range(dist) is not None, dist
        assert untested(dist) is None, untested(dist)  # the suite runs on what it was tested with
    assert "2.14.1" in versions.tested_range("torch") and "0.29.1" in versions.tested_range("torchvision")


def test_an_untested_release_is_one_line_naming_the_package_and_range(monkeypatch):
    spec = versions.tested_range("timm")
    for version in ("1.1.0", "1.0.30", "0.9.16", "not-a-version"):
        faking(monkeypatch, "timm", version)
        assert untested("timm") == (
            f"timm {version} is outside the versions coop is tested with (timm{spec}, pyproject.toml)"
        )
    faking(monkeypatch, "timm", "1.0.40")  # a later patch release of the tested minor
    assert untested("timm") is None
    faking(monkeypatch, "timm", None)  # not installed: nothing to say
    assert untested("timm") is None and untested("no-such-package") is None


def test_an_untested_timm_keeps_open_clips_image_tower_with_the_line(monkeypatch):
    from coop.model.support import meta_image_tower

    tower, refusal = meta_image_tower("ViT-B-16-SigLIP")  # timm's ViT trunk, walked
    assert refusal is None and type(tower).__name__ == "TimmImageTower"
    faking(monkeypatch, "timm", "1.1.0")
    tower, refusal = meta_image_tower("ViT-B-16-SigLIP")
    assert type(tower).__name__ == "TimmModel" and "\n" not in refusal
    assert refusal == (
        f"timm 1.1.0 is outside the versions coop is tested with (timm{versions.tested_range('timm')}, "
        "pyproject.toml): model ViT-B-16-SigLIP's timm image tower is not walked, so it takes no "
        "vision prompts"
    )
    assert meta_image_tower("ViT-B-16")[1] is None  # open_clip's own ViT: no timm internals read


def test_an_untested_open_clip_warns_that_its_model_list_may_differ(monkeypatch, caplog):
    from coop.model.support import openclip_models

    with caplog.at_level(logging.WARNING, logger="coop"):
        names = openclip_models()
    assert not caplog.records
    faking(monkeypatch, "open_clip_torch", "3.4.0")
    with caplog.at_level(logging.WARNING, logger="coop"):
        assert openclip_models() == names
    (record,) = caplog.records
    assert record.getMessage().startswith("open_clip_torch 3.4.0 is outside the versions coop is tested with")
    assert record.getMessage().endswith(": its model list may differ from docs/models.md's")


def test_an_untested_flower_leaves_its_actor_pool_alone(monkeypatch, caplog):
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    from coop.federated import ray_pool

    flowers = BasicActorPool.fetch_result_and_return_actor_to_pool
    monkeypatch.setattr(BasicActorPool, "fetch_result_and_return_actor_to_pool", flowers)  # restored
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flwr-simulation"])
    faking(monkeypatch, "flwr", "1.43.0")
    with caplog.at_level(logging.WARNING, logger="coop"):
        assert ray_pool.install() is False
    assert BasicActorPool.fetch_result_and_return_actor_to_pool is flowers
    (record,) = caplog.records
    assert record.getMessage() == (
        f"flwr 1.43.0 is outside the versions coop is tested with (flwr{versions.tested_range('flwr')}, "
        "pyproject.toml): a lost Ray actor is not replaced (coop.federated.ray_pool)"
    )
    faking(monkeypatch, "flwr", installed("flwr"))  # the tested release: the pool is wrapped
    assert ray_pool.install() is True
    assert BasicActorPool.fetch_result_and_return_actor_to_pool.coop_replaces_lost_actors
