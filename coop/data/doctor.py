"""The data doctor: is a CoOp DATA folder usable, and if not, what exactly to do about it.

    reports = [check_dataset(name, "/data") for name in COOP_DATASETS]
    print(format_reports(reports))        # one row per dataset, then one line per problem

Per dataset it checks, read-only (nothing is ever written into DATA):

1. the dataset folder, image folder and split (or class-list) files where our readers look for
   them; the paths come from the readers' own layouts (`coop.data.datasets`,
   `coop.data.imagenet_variants`), so the doctor and the readers cannot disagree. A missing
   one that exists elsewhere under DATA (a renamed or doubly extracted folder) is reported as
   misplaced, with where to move it;
2. that the reader parses the split (the reader's own one-line error otherwise);
3. the number of classes and of images per split, against CoOp's published split sizes
   (`coop.data.catalog.COOP_SPLIT_SIZES`): an empty split is an error, other sizes a difference;
4. that every image the split lists exists;
5. that images decode: a sample of `sample` images, or all of them (`sample=None`);
6. with a description file (`data.descriptions`, `coop.data.descriptions`): every class has
   sentences (an error per class without an entry or with an empty list), and no sentence is
   longer than the tokenizer's context (a warning per class: a run truncates them);
7. 2SFS's released few-shot split files in the dataset's `split_fewshot/` (`coop.data.jsonl_splits`,
   `data.fewshot_source=jsonl`): every entry of each resolves to an image of the split it names
   (train or val), with the reader's label (an error per file, naming its first bad line).

CIFAR-10/100 (`coop.data.cifar`) are torchvision's python-version folders: the doctor checks their
files and counts (torchvision checks the MD5 sums) and decodes the PNGs only once a read has
written them.

Findings are of three kinds. **Errors** make the dataset unusable: a run would fail or silently
lose images (a missing or misplaced file, a split the reader cannot parse, an empty split,
missing or corrupt images, a class without descriptions). **Differences** leave it usable but not
comparable with the papers: the data reads, and its sizes differ from CoOp's published split.
**Warnings** leave it usable and comparable (sentences a run truncates). Every finding comes with one
line saying what to do: which file to fetch, from where CoOp's
DATASETS.md says to get it (`coop.data.catalog.DOWNLOADS`), and where to put it. Entry point:
`tools/check_data.py`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from coop.data.base import DataError, Source
from coop.data.catalog import CHECKABLE, COOP_DATASETS, COOP_SPLIT_SIZES, DOWNLOADS  # noqa: F401 (re-exported)
from coop.data.cifar import CIFAR_FOLDERS, cifar_files, read_cifar
from coop.data.datasets import (
    FGVC_LAYOUT,
    FGVC_LISTS,
    IMAGENET_FOLDERS,
    IMAGENET_LAYOUT,
    SPLIT_JSON_LAYOUTS,
    read_fgvc_aircraft,
    read_imagefolder,
    read_imagenet,
    read_split_json_dataset,
)
from coop.data.descriptions import check_descriptions
from coop.data.fewshot import FEWSHOT_DIR
from coop.data.imagenet_variants import CLASSNAMES_FILE, IMAGENET_VARIANTS, read_imagenet_variant
from coop.data.images import load_image
from coop.data.jsonl_splits import JSONL_FILE, read_jsonl_split

GENERIC_NAMES = frozenset({"images", "jpg", "train", "val", "test", CLASSNAMES_FILE})  # not searched for
SEARCH_DEPTH = 3  # how deep under DATA a misplaced file or folder is looked for


@dataclass
class Layout:
    """Where the reader of one dataset looks: its folders and files, as absolute paths."""

    folder: str
    images: str
    files: list[str]  # split / class-list files
    dirs: list[str] = field(default_factory=list)  # further folders the reader requires


def layout(name: str, root: str, split_file: str | None = None) -> Layout:
    """The paths `name`'s reader requires under the DATA folder `root` (from the readers' layouts).

    Args:
        name: one of `CHECKABLE`.
        root: the DATA folder (for `imagefolder`: the folder itself).
        split_file: `imagefolder` only: the split JSON it is read through.
    """
    root = os.path.abspath(os.path.expanduser(root))
    if name in SPLIT_JSON_LAYOUTS:
        folder, images, split = SPLIT_JSON_LAYOUTS[name]
        d = os.path.join(root, folder)
        return Layout(d, os.path.join(d, images), [os.path.join(d, split)])
    if name == "imagenet":
        folder, images, classes = IMAGENET_LAYOUT
        d = os.path.join(root, folder)
        image_dir = os.path.join(d, images)
        return Layout(
            d, image_dir, [os.path.join(d, classes)], [os.path.join(image_dir, f) for f in IMAGENET_FOLDERS]
        )
    if name == "fgvc_aircraft":
        folder, images, classes = FGVC_LAYOUT
        d = os.path.join(root, folder)
        lists = [os.path.join(d, FGVC_LISTS.format(split=s)) for s in ("train", "val", "test")]
        return Layout(d, os.path.join(d, images), [os.path.join(d, classes), *lists])
    if name in IMAGENET_VARIANTS:
        v = IMAGENET_VARIANTS[name]
        d = os.path.join(root, v.folder)
        return Layout(d, os.path.join(d, v.images), [os.path.join(d, CLASSNAMES_FILE)])
    if name in CIFAR_FOLDERS:  # torchvision's python-version folder; images are its arrays
        d = os.path.join(root, CIFAR_FOLDERS[name])
        return Layout(d, d, [os.path.join(d, f) for f in cifar_files(name)])
    if name == "imagefolder":
        if split_file is not None:
            return Layout(root, root, [os.path.abspath(split_file)])
        return Layout(root, root, [], [os.path.join(root, "train"), os.path.join(root, "test")])
    raise DataError(f"the data doctor checks {', '.join(CHECKABLE)}; not {name!r}")


def read_source(name: str, root: str, split_file: str | None = None) -> Source:
    """The reader's full splits, read without writing anything (no ImageNet listing cache)."""
    if name in SPLIT_JSON_LAYOUTS:
        return read_split_json_dataset(root, name)
    if name == "imagenet":
        return read_imagenet(root, write_cache=False)
    if name == "fgvc_aircraft":
        return read_fgvc_aircraft(root)
    if name in IMAGENET_VARIANTS:
        return read_imagenet_variant(root, name)
    if name in CIFAR_FOLDERS:
        return read_cifar(root, name, write=False)
    return read_imagefolder(root, split_file)


@dataclass
class Report:
    """The doctor's findings for one dataset: counts (None where unreadable) and (problem, fix)
    pairs, split into errors (unusable), differences (usable, differs from CoOp's split) and
    warnings (usable, worth a look: descriptions a run truncates)."""

    name: str
    counts: dict[str, int] | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)
    differences: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # usable as is (long descriptions)

    @property
    def usable(self) -> bool:
        """A run can read every image of every split."""
        return not self.errors

    @property
    def ok(self) -> bool:
        """Usable and of CoOp's published split sizes."""
        return not self.errors and not self.differences

    @property
    def problems(self) -> list[tuple[str, str]]:
        """Errors, then differences, then warnings."""
        return self.errors + self.differences + self.warnings

    @property
    def status(self) -> str:
        if self.errors:
            return f"not usable: {len(self.errors)} error(s)"
        if self.differences:
            return f"usable, differs from CoOp's split ({len(self.differences)})"
        return "ok"


def index_tree(root: str, depth: int = SEARCH_DEPTH) -> dict[str, list[str]]:
    """{lower-case name: paths} of every file and folder at most `depth` levels under `root`."""
    out: dict[str, list[str]] = {}
    stack = [(os.path.abspath(root), 0)]
    while stack:
        folder, level = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            out.setdefault(e.name.lower(), []).append(e.path)
            if level + 1 < depth and e.is_dir(follow_symlinks=False):
                stack.append((e.path, level + 1))
    return out


def _fetch(name: str, role: str, target: str) -> str:
    if name == "imagefolder":  # a custom dataset: nothing to download, something to make
        if role == "files":
            return f"write it with tools/make_split.py <folder of class folders> --out {target}"
        return f"create {target} with one sub-folder of images per class"
    what, where = DOWNLOADS.get(name, {}).get(role, ("it", "where the dataset is published"))
    if role == "images":
        return f"fetch {what} from {where} and extract it so that its images are in {target}"
    return f"fetch {what} from {where} and put it at {target}"


def misplaced(path: str, folder: str, index) -> tuple[str, str, str] | None:
    """(what was found, what to move, where to) for a missing `path` that exists elsewhere, or None.

    A find at `<H>/<path relative to folder>` means the whole dataset folder is at H (renamed,
    or extracted one level too deep): move H to `folder`. Generic names are not searched for.
    """
    base = os.path.basename(path)
    if base.lower() in GENERIC_NAMES:
        return None
    found = [c for c in index().get(base.lower(), []) if c != path]
    if not found:
        return None
    rel = os.path.relpath(path, folder)
    if found[0].endswith(os.sep + rel) and found[0][: -len(rel) - 1] != folder:
        return found[0], found[0][: -len(rel) - 1], folder
    return found[0], found[0], path


def check_paths(name: str, lay: Layout, index) -> list[tuple[str, str]]:
    """(problem, fix) for each path of `lay` that is missing; a misplaced one says where to move it."""
    wanted = [(p, "files") for p in lay.files] + [(lay.images, "images")] + [(d, "images") for d in lay.dirs]
    problems, moves = [], []
    for path, role in wanted:
        if os.path.exists(path):
            continue
        rel = os.path.relpath(path, lay.folder)
        if any(os.path.exists(os.path.join(src, rel)) for src, _ in moves):
            continue  # the folder move already suggested brings it along
        where = misplaced(path, lay.folder, index)
        if where is None:
            problems.append((f"{path} is missing", _fetch(name, role, path)))
            continue
        found, src, dest = where
        moves.append((src, dest))
        problems.append((f"{path} is missing, but {found} exists", f"move {src} to {dest}"))
    return problems


def check_counts(name: str, lay: Layout, src: Source) -> tuple[list, list]:
    """(errors, differences) as (problem, fix) pairs: a split that CoOp's has and this one lacks
    (empty) is an error; every other count that differs from CoOp's published sizes a difference."""
    if name not in COOP_SPLIT_SIZES:
        return [], []
    # a split file (or FGVC's lists) decides the counts; for the others, the image folders do
    from_files = name in SPLIT_JSON_LAYOUTS or name == "fgvc_aircraft"
    role, target = ("files", lay.files[0]) if from_files else ("images", lay.images)
    got = counts_of(src)
    errors, differences = [], []
    for key, want in zip(("classes", "train", "val", "test"), COOP_SPLIT_SIZES[name], strict=True):
        if want is not None and got[key] != want:
            unit = "classes" if key == "classes" else f"{key} images"
            fix = "an incomplete or different download: " + _fetch(name, role, target)
            found = errors if got[key] == 0 else differences
            found.append((f"{got[key]:,} {unit}, CoOp's split has {want:,}", fix))
    return errors, differences


def counts_of(src: Source) -> dict[str, int]:
    return {
        "classes": len(src.classnames),
        "train": len(src.train),
        "val": len(src.val),
        "test": len(src.test),
    }


def unique_images(src: Source) -> list[str]:
    """Every image path the splits list, once (ImageNet's val is its test split), in split order."""
    return list(dict.fromkeys(d.path for split in (src.train, src.val, src.test) for d in split))


def check_images(name: str, src: Source, sample: int | None, seed: int = 0) -> list[tuple[str, str]]:
    """(problem, fix) for listed images that are missing, and for sampled images that do not decode.

    Args:
        name: the dataset.
        src: its full splits.
        sample: how many existing images to decode (a seeded random sample); None decodes all.
        seed: the sample's seed.
    """
    paths = unique_images(src)
    missing = [p for p in paths if not os.path.isfile(p)]
    problems = []
    if missing:
        problems.append(
            (
                f"{len(missing):,} of {len(paths):,} images listed in the split are missing (e.g. {missing[0]})",
                _fetch(name, "images", src.image_dir),
            )
        )
    present = [p for p in paths if os.path.isfile(p)] if missing else paths
    chosen = (
        present if sample is None or sample >= len(present) else random.Random(seed).sample(present, sample)
    )
    bad = []
    for path in tqdm(chosen, desc=f"{name}: decoding", unit="img", leave=False, dynamic_ncols=True):
        try:
            load_image(path)
        except DataError:
            bad.append(path)
    if bad:
        scope = "all" if len(chosen) == len(present) else "a sample of"
        problems.append(
            (
                f"{len(bad):,} of {scope} {len(chosen):,} images do not decode (e.g. {bad[0]})",
                f"{_fetch(name, 'images', src.image_dir)}; or train with data.skip_corrupt=true",
            )
        )
    return problems


def check_jsonl_splits(src: Source) -> list[tuple[str, str]]:
    """(problem, fix) for each 2SFS split file in `src`'s `split_fewshot/` with an entry that does not
    resolve (`coop.data.jsonl_splits.read_jsonl_split`: the first bad line)."""
    folder = os.path.join(src.dataset_dir or "", FEWSHOT_DIR)
    if src.dataset_dir is None or not os.path.isdir(folder):
        return []
    files = sorted(f for f in os.listdir(folder) if JSONL_FILE.fullmatch(f))
    problems = []
    for f in files:
        try:
            read_jsonl_split(Path(folder) / f, src)
        except DataError as e:
            fix = "fetch it again with 2SFS's scripts/download_splits.sh, or fix the dataset's images"
            problems.append((str(e), fix))
    return problems


def check_dataset(
    name: str,
    root,
    sample: int | None = 50,
    split_file: str | None = None,
    descriptions: str | None = None,
    tokens: tuple[Callable[[str], int], int] | None = None,
) -> Report:
    """Every check of the module docstring for one dataset; never writes anything.

    Args:
        name: one of `CHECKABLE`.
        root: the DATA folder (for `imagefolder`: the dataset folder).
        sample: images to decode per dataset; None decodes every image.
        split_file: `imagefolder` only: the split JSON to read it through.
        descriptions: a description file (`data.descriptions`) to check against the classes.
        tokens: (a sentence -> its token count, the context length) of the tokenizer the
            descriptions are checked against; needed with `descriptions`.
    """
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    lay = layout(name, root, split_file)
    cache: dict = {}

    def index():
        if "tree" not in cache:
            cache["tree"] = index_tree(root)
        return cache["tree"]

    report = Report(name, errors=check_paths(name, lay, index))
    if report.errors:
        return report
    try:
        src = read_source(name, root, split_file)
    except DataError as e:
        target = lay.files[0] if lay.files else lay.folder
        report.errors.append(
            (f"the reader cannot use it: {e}", "fetch it again: " + _fetch(name, "files", target))
        )
        return report
    report.counts = counts_of(src)
    errors, report.differences = check_counts(name, lay, src)
    report.errors += errors
    if name not in CIFAR_FOLDERS or os.path.isdir(os.path.join(src.image_dir, "train")):
        report.errors += check_images(name, src, sample)  # CIFAR: torchvision checked the arrays' MD5s
    report.errors += check_jsonl_splits(src)
    if descriptions is not None:
        try:
            errors, warnings = check_descriptions(descriptions, src.classnames, *tokens)
        except DataError as e:
            errors, warnings = [(str(e), "write it with tools/describe.py, or give the right file")], []
        report.errors += errors
        report.warnings += warnings
    return report


def format_reports(reports: list[Report]) -> str:
    """A Markdown table (one row per dataset: its status and counts), then one line per finding:
    errors first ("error"), then differences ("differs"), then warnings ("warning")."""
    lines = ["| dataset | status | classes | train | val | test |", "|---|---|---|---|---|---|"]
    for r in reports:
        c = r.counts or {}
        cells = [f"{c[k]:,}" if k in c else "–" for k in ("classes", "train", "val", "test")]
        lines.append(f"| {r.name} | {r.status} | " + " | ".join(cells) + " |")
    todo = [f"- {r.name} (error): {problem} -> {fix}" for r in reports for problem, fix in r.errors]
    todo += [f"- {r.name} (differs): {problem} -> {fix}" for r in reports for problem, fix in r.differences]
    todo += [f"- {r.name} (warning): {problem} -> {fix}" for r in reports for problem, fix in r.warnings]
    if todo:
        lines += ["", "What to do:", *todo]
    return "\n".join(lines)
