"""The dependencies whose private internals coop reads, held to the versions the suite passed on.

    problem = untested("timm")    # None inside the tested range, else one line naming the package,
                                  #   its version and the range
    tested_range("flwr")          # SpecifierSet(">=1.42.0,<1.43")

The tested ranges are pyproject.toml's own requirements (`[project]` dependencies and extras), the
one statement of what the suite passed on; requirements-lock.txt pins the exact set. They are read
from the source tree's pyproject.toml when coop runs from a checkout (an editable install's
metadata goes stale when pyproject.toml changes), else from the installed package's metadata.

Where coop reaches into a private internal, an untested version degrades that feature with the
one line, rather than failing somewhere inside the dependency:

- timm: `coop.model.image_timm` walks timm's ViT and Eva trunks through `_pos_embed`, their rotary
  angles and `num_prefix_tokens`; an untested timm keeps open_clip's own image tower (no vision
  prompts on timm towers, the line is the refusal).
- open_clip_torch: `coop.model.support` reads the model configs open_clip ships (its model list)
  and builds towers with its private builders; the support table logs the line (docs/models.md was
  made with the tested release).
- flwr: `coop.federated.ray_pool` wraps Flower's private `BasicActorPool`; under an untested Flower
  it logs the line and leaves the pool alone (a lost Ray actor then fails its later clients).
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # in a checkout


def installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, None if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirements() -> list[str]:
    """coop's requirement strings: the checkout's pyproject.toml, else the installed metadata."""
    if PYPROJECT.is_file():
        project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "coop":
            extras = project.get("optional-dependencies", {}).values()
            return [*project.get("dependencies", []), *(r for extra in extras for r in extra)]
    return importlib.metadata.requires("coop") or []


@functools.cache
def tested_ranges() -> dict[str, SpecifierSet]:
    """Each requirement's range by its canonical name (coop's own extras left out)."""
    ranges = {}
    for text in _requirements():
        req = Requirement(text)
        if canonicalize_name(req.name) != "coop":
            ranges[canonicalize_name(req.name)] = req.specifier
    return ranges


def tested_range(dist: str) -> SpecifierSet | None:
    """The range of `dist` that the suite passed on (pyproject.toml), None if coop states none."""
    return tested_ranges().get(canonicalize_name(dist))


def untested(dist: str) -> str | None:
    """None if the installed `dist` lies in its tested range (or is not installed, or has no
    range), else one line: the package, its version and the tested range."""
    version, spec = installed(dist), tested_range(dist)
    if version is None or spec is None:
        return None
    try:
        inside = spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return f"{dist} {version} is outside the versions coop is tested with ({dist}{spec}, pyproject.toml)"
