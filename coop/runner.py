"""A training run as a folder: resume, checkpoint every epoch, write metrics when done.

    from coop.config import load_config
    from coop.runner import train_run
    metrics = train_run(load_config(None, ["model.pretrained=none", "data.shots=4"]))

Folder contents: `config.yaml` (resolved config), `log.txt`, `history.csv` (one row per epoch;
`lr` is the rate that epoch trained at), `checkpoint.pt` (prompt tensors + optimizer/epoch/RNG
state and the lr schedule's name, written atomically after every epoch) and, when finished,
`metrics.json`.

The lr of an epoch is a function of the epoch alone (`coop.engine.epoch_lr`), set before the epoch
starts, so a resumed run needs no scheduler state beyond the epoch it resumes at. A checkpoint that
is unreadable, truncated or not a coop checkpoint stops the run with a one-line `CheckpointError`.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import random
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import trange

from coop.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from coop.config import RESULT_FREE_KEYS, flatten, model_tag, resolved_epochs, to_yaml
from coop.engine import (
    LR_SCHEDULE,
    NonFiniteLossError,
    Setup,
    default_output_dir,
    epoch_lr,
    eval_features,
    evaluate,
    setup,
    train_one_epoch,
    training_features,
)
from coop.io import atomic_write, write_json

log = logging.getLogger(__name__)

HISTORY_FIELDS = ["epoch", "loss", "train_acc", "lr", "time_s"]


class RunError(ValueError):
    """The run folder cannot be used (e.g. it holds a run with another config)."""


def attach_log_file(folder: Path) -> logging.Handler:
    handler = logging.FileHandler(folder / "log.txt")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def check_same_config(old: dict, new: dict, folder: Path) -> None:
    a, b = flatten(old), flatten(new)
    diff = [k for k in sorted(set(a) | set(b)) if k not in RESULT_FREE_KEYS and a.get(k) != b.get(k)]
    if diff:
        k = diff[0]
        raise RunError(
            f"{folder} holds a run with a different config ({k}: {a.get(k)!r} there, {b.get(k)!r} now); "
            "use another output_dir"
        )


def write_history(folder: Path, history: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HISTORY_FIELDS)
    writer.writeheader()
    writer.writerows(history)
    atomic_write(folder / "history.csv", lambda tmp: Path(tmp).write_text(buf.getvalue()))


def train_run(cfg: DictConfig) -> dict:
    """Train (or resume, or skip if finished) the run described by `cfg`; returns its metrics."""
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir(cfg)
    folder = Path(cfg.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    handler = attach_log_file(folder)
    try:
        return _train_run(cfg, folder)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def read_resume_checkpoint(path: Path) -> dict | None:
    """The checkpoint to resume from, None if there is none; CheckpointError if it is unusable."""
    if not path.is_file():
        return None
    try:
        return load_checkpoint(path, training_state=True)
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume: {e}; delete it or use another output_dir") from None


def _train_run(cfg: DictConfig, folder: Path) -> dict:
    config = OmegaConf.to_container(cfg, resolve=True)
    ckpt_path, metrics_path = folder / "checkpoint.pt", folder / "metrics.json"
    ckpt = read_resume_checkpoint(ckpt_path)
    if ckpt is not None:
        check_same_config(ckpt["config"], config, folder)
        if ckpt.get("finished") and metrics_path.is_file():
            log.info("%s is finished; not training again", folder)
            return json.loads(metrics_path.read_text())
    atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(to_yaml(cfg)))

    s = setup(cfg)
    learner = s.classifier.prompt_learner
    optimizer = torch.optim.SGD(
        learner.parameters(),
        lr=float(cfg.train.lr),
        momentum=float(cfg.train.momentum),
        weight_decay=float(cfg.train.weight_decay),
    )
    start, history = restore(ckpt, s, optimizer, folder) if ckpt is not None else (0, [])
    epochs = resolved_epochs(cfg)
    log.info(
        "%s | %s (%s) | %d classes, %d shots, seed %d | %d epochs | %d prompt parameters | %s %s",
        cfg.data.name,
        cfg.model.name,
        cfg.model.pretrained,
        learner.n_cls,
        cfg.data.shots,
        cfg.data.seed,
        epochs,
        sum(p.numel() for p in learner.parameters()),
        s.device,
        s.precision,
    )
    state = {"config": config, "classnames": list(s.dataset.classnames), "n_ctx": learner.n_ctx}

    def checkpoint(epoch: int, finished: bool) -> None:
        save_checkpoint(
            ckpt_path,
            {
                **state,
                "prompt": {k: v.detach().cpu() for k, v in learner.prompt_tensors().items()},
                "optimizer": optimizer.state_dict(),
                "lr_schedule": LR_SCHEDULE,
                "epoch": epoch,
                "finished": finished,
                "history": history,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            },
        )

    fit(s, optimizer, start, epochs, history, checkpoint, folder)
    metrics = finalize(s, epochs, history, metrics_path)
    checkpoint(epochs, finished=True)
    return metrics


def restore(ckpt: dict, s: Setup, optimizer, folder: Path) -> tuple[int, list[dict]]:
    """Load a checkpoint's prompts, optimizer and RNG state; returns (start epoch, history).

    Checkpoints written before the lr schedule restarted its cosine after warm-up trained every
    epoch >= W at another rate; such a run can only be resumed while it is still in warm-up.
    """
    start, warmup = int(ckpt["epoch"]), int(s.cfg.train.warmup_epochs)
    if ckpt.get("lr_schedule") != LR_SCHEDULE and warmup > 0 and start > warmup:
        raise RunError(
            f"{folder} was trained for {start} epochs under an older lr schedule (its cosine did not "
            "restart after warm-up); use another output_dir"
        )
    learner = s.classifier.prompt_learner
    with torch.no_grad():
        for name, tensor in ckpt["prompt"].items():
            getattr(learner, name).copy_(tensor)
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    log.info("resuming %s from epoch %d", folder, start)
    return start, list(ckpt["history"])


def fit(s: Setup, optimizer, start: int, epochs: int, history: list[dict], checkpoint, folder: Path) -> None:
    """Train epochs start..epochs-1, appending to `history` and checkpointing after each."""
    cfg, learner = s.cfg, s.classifier.prompt_learner
    train_feats = training_features(s) if start < epochs else None
    log_every = max(1, epochs // 10)
    bar = trange(start, epochs, initial=start, total=epochs, desc="epochs", dynamic_ncols=True)
    for epoch in bar:
        t0 = time.perf_counter()
        lr = epoch_lr(
            epoch,
            lr=float(cfg.train.lr),
            epochs=epochs,
            warmup_epochs=int(cfg.train.warmup_epochs),
            warmup_lr=float(cfg.train.warmup_lr),
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        kept = (
            f"the last good checkpoint is {folder / 'checkpoint.pt'} (epoch {epoch})"
            if epoch
            else "no checkpoint was written"
        )
        try:
            stats = train_one_epoch(s, optimizer, epoch, train_feats, s.precision)
        except NonFiniteLossError as e:
            raise NonFiniteLossError(f"{e}; {kept}") from None
        if not all(torch.isfinite(p).all() for p in learner.parameters()):
            raise NonFiniteLossError(f"prompt parameters became non-finite in epoch {epoch + 1}; {kept}")
        row = {"epoch": epoch + 1, **{k: round(v, 6) for k, v in stats.items()}, "lr": lr}
        history.append({**row, "time_s": round(time.perf_counter() - t0, 3)})
        checkpoint(epoch + 1, finished=False)
        write_history(folder, history)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", acc=f"{stats['train_acc']:.1f}")
        if (epoch + 1) % log_every == 0 or epoch + 1 == epochs:
            log.info(
                "epoch %d/%d loss %.4f train acc %.2f%% lr %.2e",
                epoch + 1,
                epochs,
                stats["loss"],
                stats["train_acc"],
                lr,
            )


def finalize(s: Setup, epochs: int, history: list[dict], metrics_path: Path) -> dict:
    """Evaluate on the test split and write `metrics.json`."""
    cfg, learner = s.cfg, s.classifier.prompt_learner
    feats, labels = eval_features(s)
    metrics = evaluate(s.classifier, feats[0], labels, s.device, s.precision)
    metrics.update(
        epochs=epochs,
        shots=int(cfg.data.shots),
        seed=int(cfg.data.seed),
        dataset=cfg.data.name,
        model=model_tag(cfg.model.name),
        pretrained=cfg.model.pretrained,
        n_ctx=learner.n_ctx,
        position=learner.position,
        csc=learner.csc,
        depth=learner.depth,
        final_train_loss=history[-1]["loss"] if history else None,
    )
    write_json(metrics_path, metrics)
    log.info(
        "test accuracy %.2f%% (macro F1 %.2f) on %d images -> %s",
        metrics["accuracy"],
        metrics["macro_f1"],
        metrics["n_test"],
        metrics_path,
    )
    return metrics


def evaluate_checkpoint(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Test accuracy of a saved prompt, on its own dataset or (shared context) on another one.

    Args:
        path: a `checkpoint.pt`.
        overrides: `key=value` changes to the run's config, e.g. "data.name=dtd", "data.root=...".

    Raises:
        CheckpointError: `path` is missing, corrupt, truncated or not a coop checkpoint.
    """
    from coop.config import load_config

    ckpt = load_checkpoint(path)
    cfg = load_config(None, overrides, base=ckpt["config"])
    s = setup(cfg, ckpt)
    feats, labels = eval_features(s)
    metrics = evaluate(s.classifier, feats[0], labels, s.device, s.precision)
    metrics.update(
        checkpoint=str(path),
        dataset=cfg.data.name,
        subsample_classes=cfg.data.subsample_classes,
        trained_on=ckpt["config"]["data"]["name"],
    )
    return metrics
