"""A test-time pass as a run folder: every test image through a test-time method, resumable.

    from coop.tta.host import tta_config
    from coop.tta.runner import tta_run
    metrics = tta_run(tta_config("configs/tta/zero.yaml", ["data.name=dtd", "data.root=DATA"]))

Before the run folder is touched: the config, the init (`coop.tta.host`), the dataset, the host,
the method (`build_tta`, which runs the method's `check_host`) and the number of ranks are checked,
each refusal in one line. Then for each image of the test split, in stream order
(`coop.tta.outputs.stream_order`), the method gets its views (`coop.tta.views`) and returns its
logits. Folder contents: `config.yaml`, `log.txt`, `metrics.json` (`coop.train.metrics.logit_metrics`:
accuracy, top5, ece, macro_f1 and per-class accuracy, in percent, with the pass's settings) and
`outputs.safetensors` (`logits`, `labels`, `index`: the image's position in the split), written
while it runs as atomic chunks (`coop.tta.outputs`) that a rerun continues after; `.lock` as for a
training run (`coop.train.lock`).

Determinism: an episodic method's outputs depend on (seed, image) alone, so under torchrun the
images of every chunk are shared among the ranks (`coop.distributed.share`), gathered, and rank 0
writes the chunk: the one-process outputs, bit for bit on CPU. An online method carries its state
along the stream; it runs on one rank (more are refused), and its `state()` is saved after every
chunk, so a pass killed at any point and rerun ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop import distributed
from coop.config.load import to_yaml
from coop.config.run_names import model_tag, tta_run_name
from coop.data import DataError, build_dataset, subsample_classes
from coop.io import atomic_write, write_json
from coop.model.weights import absolute_model_files, absolute_tokenizer_dir
from coop.train.engine import resolve_device
from coop.train.lock import require_run_folder, run_lock
from coop.train.metrics import logit_metrics
from coop.train.precision import autocast
from coop.train.runner import attach_log_file, check_same_config
from coop.tta import build_tta, outputs, tta_class
from coop.tta.base import TestTimeError, TestTimeMethod
from coop.tta.host import Host, build_host
from coop.tta.views import ViewDataset, ViewMaker, augment_for

DEFAULT_VIEWS = 64  # tta.views=null and a method without a per-dataset number
log = logging.getLogger(__name__)


def default_output_dir(cfg: DictConfig) -> str:
    """output/<coop.config.run_names.tta_run_name>."""
    return str(Path("output") / tta_run_name(cfg))


def tta_run(cfg: DictConfig) -> dict:
    """Run (or resume, or return the finished) test-time pass of `cfg`; returns its metrics."""
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir(cfg)
    # as a training run records them: a resumed pass compares the same paths from any directory
    cfg.model.name, cfg.model.pretrained = absolute_model_files(cfg.model.name, cfg.model.pretrained)
    cfg.model.tokenizer = absolute_tokenizer_dir(cfg.model.tokenizer)
    folder = require_run_folder(cfg.output_dir)
    world = distributed.world()
    if tta_class(cfg.tta.method).kind == "online" and world.size > 1:  # before the process group
        raise TestTimeError(
            f"tta.method={cfg.tta.method} is online: its state follows one stream of images, which "
            f"{world.size} ranks cannot share; run it in one process"
        )
    device = distributed.init(resolve_device(cfg.device), cfg.train.dist_backend)
    dataset = subsample_classes(
        build_dataset(
            cfg.data.name, cfg.data.root, shots=0, seed=int(cfg.data.seed), split_file=cfg.data.split_file
        ),
        cfg.data.subsample_classes,
    )
    if not dataset.test:
        raise DataError(f"the test split of {cfg.data.name} has no images")
    host = build_host(cfg, list(dataset.classnames), device)
    method = build_tta(host.method, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    with run_lock(folder) if world.is_main else contextlib.nullcontext():
        handler = attach_log_file(
            folder, world.log_name, logging.NOTSET if world.is_main else logging.WARNING
        )
        try:
            return _tta_run(cfg, folder, dataset, host, method, device)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()


def views_of(cfg: DictConfig, method: TestTimeMethod) -> int:
    """The views per test image: `tta.views`, or where it is null the method's original's number for
    the dataset (`TestTimeMethod.views_for`: TDA's image alone on the cross-dataset sets), else 64."""
    if cfg.tta.views is not None:
        return int(cfg.tta.views)
    return int(method.views_for(cfg) or DEFAULT_VIEWS)


def _tta_run(cfg: DictConfig, folder: Path, dataset, host: Host, method: TestTimeMethod, device) -> dict:
    config = OmegaConf.to_container(cfg, resolve=True)
    if (folder / "config.yaml").is_file():
        check_same_config(yaml.safe_load((folder / "config.yaml").read_text()), config, folder)
    metrics_path = folder / "metrics.json"
    if metrics_path.is_file() and (folder / outputs.OUTPUTS).is_file():
        log.info("%s is finished; not running again", folder)
        return json.loads(metrics_path.read_text())
    atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(to_yaml(cfg)))
    augment = augment_for(cfg.tta.augment or method.augment, cfg.data.name)
    views = views_of(cfg, method)
    items = dataset.test
    log.info(
        "%s | tta.method=%s (%s) on %s%s | %d views (%s) | %d images, %d classes, seed %d | %s %s",
        cfg.data.name,
        method.name,
        method.kind,
        cfg.method,
        "" if cfg.tta.init is None else f" from {cfg.tta.init}",
        views,
        augment if views > 1 else "the image alone",
        len(items),
        len(dataset.classnames),
        cfg.data.seed,
        device,
        host.precision,
    )
    maker = ViewMaker(host.transform, views, augment, int(cfg.data.seed))
    images = ViewDataset(items, maker, skip_corrupt=bool(cfg.data.skip_corrupt))
    order = outputs.stream_order(len(items), method.kind == "online", int(cfg.data.seed))
    start = distributed.broadcast(resume(folder, method) if distributed.is_main() else None)
    if method.kind == "online" and start:
        method.load_state(outputs.load_state(folder)[1])
    run_stream(cfg, folder, images, order, start, host, method, device)
    distributed.barrier()
    return finalize(cfg, folder, method, augment, len(dataset.classnames), len(items))


def resume(folder: Path, method: TestTimeMethod) -> int:
    """The stream position a rerun continues at: after the chunks written, for an online method after
    its last saved state (later chunks are deleted)."""
    written = outputs.covered(folder)
    if method.kind == "online":
        position = outputs.load_state(folder)[0]
        outputs.drop_after(folder, position)
        written = min(written, position)
    if written:
        log.info("resuming %s after %d images", folder, written)
    return written


def run_stream(
    cfg: DictConfig,
    folder: Path,
    images: ViewDataset,
    order: torch.Tensor,
    start: int,
    host: Host,
    method: TestTimeMethod,
    device: torch.device,
) -> None:
    """Stream positions start..N-1, `tta.chunk` at a time: each chunk's images shared among the ranks,
    its outputs gathered and written by rank 0 (then an online method's state)."""
    n, size, n_cls = len(order), int(cfg.tta.chunk), host.method.n_cls
    bounds = [(a, min(a + size, n)) for a in range(start, n, size)]
    mine = []  # this rank's share of each chunk, in stream order
    for a, b in bounds:
        lo, hi = distributed.share(b - a)
        mine.append(order[a + lo : a + hi].tolist())
    loader = DataLoader(
        images,
        batch_size=None,
        sampler=[i for share in mine for i in share],
        num_workers=int(cfg.data.num_workers),
    )
    batches = iter(loader)
    dtype = host.method.clip.logit_scale.dtype
    bar = tqdm(total=n, initial=start, desc=f"tta.method={method.name}", unit="img", dynamic_ncols=True)
    for (a, b), share in zip(bounds, mine, strict=True):
        rows = []
        for i in share:
            item = next(batches)
            if item is None:
                log.warning("skipping unreadable image %s", images.items[i].path)
                continue
            views, label, index = item
            with autocast(device, host.precision):
                logits = method.predict(views.to(device, dtype), index)
            rows.append((logits.detach().float().cpu(), int(label), int(index)))
        rows = [r for part in distributed.gather(rows) for r in part]  # rank order is stream order
        outputs.write_chunk(folder, a, b, rows, n_cls)
        if method.kind == "online":
            outputs.save_state(folder, b, method.state())
        bar.update(b - a)
    bar.close()


def finalize(cfg: DictConfig, folder: Path, method: TestTimeMethod, augment: str, n_cls: int, n: int) -> dict:
    """`outputs.safetensors` and `metrics.json` from the chunks, by rank 0; its metrics (or its one
    problem) reach every rank."""
    metrics = None
    if distributed.is_main():
        result = outputs.join_chunks(folder)
        metrics = describe(cfg, method, augment, n_cls, n, result) if len(result["labels"]) else None
        if metrics is not None:
            outputs.write_outputs(folder, result)
            write_json(folder / "metrics.json", metrics)
    metrics = distributed.broadcast(metrics)  # not the outputs: N x classes logits stay on rank 0
    if metrics is None:
        raise DataError(f"no readable images in the test split of {cfg.data.name}")
    log.info(
        "test accuracy %.2f%% (top-5 %.2f%%, ECE %.2f, macro F1 %.2f) on %d images -> %s",
        metrics["accuracy"],
        metrics["top5"],
        metrics["ece"],
        metrics["macro_f1"],
        metrics["n_test"],
        folder / "metrics.json",
    )
    return metrics


def describe(cfg: DictConfig, method: TestTimeMethod, augment: str, n_cls: int, n: int, result: dict) -> dict:
    """metrics.json: `logit_metrics` of the outputs (N x classes), and the pass's settings."""
    return {
        **logit_metrics(result["logits"], result["labels"]),
        "tta_method": method.name,
        "kind": method.kind,
        "method": cfg.method,  # the host's
        "init": cfg.tta.init,
        "views": views_of(cfg, method),
        "augment": augment if views_of(cfg, method) > 1 else None,
        "seed": int(cfg.data.seed),
        "order_seed": int(cfg.data.seed) if method.kind == "online" else None,
        "dataset": cfg.data.name,
        "model": model_tag(cfg.model.name),
        "pretrained": cfg.model.pretrained,
        "n_classes": n_cls,
        "n_skipped": n - len(result["labels"]),
        **method.describe(),
    }
