"""A training run as a folder: resume, checkpoint every epoch, write metrics when done.

    from coop.config.load import load_config
    from coop.train.runner import train_run
    metrics = train_run(load_config(None, ["model.pretrained=none", "data.shots=4"]))

The runner never branches on the method (`cfg.method`, see `coop.methods`): it runs the steps the
method has (`fit` on the training features it asks for, SGD epochs when `trainer == "sgd"`, `tune`
on the val split when `tunes_on_val`), then evaluates on test.

Folder contents: `config.yaml` (resolved config), `log.txt`, `history.csv` (one row per epoch;
`lr` is the rate that epoch trained at), `checkpoint.pt` (the method's learned tensors +
optimizer/epoch/RNG state, the lr schedule's name and the tokenizer's identity, which eval and
predict compare theirs with; written atomically after every epoch),
when finished `metrics.json`, and one `eval_<dataset>.json` per `eval.targets` entry (plus
`eval_<dataset>_new.json` for a base-to-new run), with the same fields as `metrics.json`; and,
with `train.tensorboard` (on by default where tensorboard is installed), `tb/` (`coop.train.tensorboard`).
`.lock` is held while a process writes the folder (`coop.train.lock`): a second one refuses. Under
torchrun (`coop.distributed`) every rank runs this same code on its share of the work; rank 0
alone holds the lock and writes the folder, rank k logs its warnings to `log.rank<k>.txt`.

The lr of a step is a function of (epoch, step) alone (`coop.train.schedule`), so a resumed run needs no
scheduler state beyond the epoch it resumes at; `history.csv`'s `lr` is the rate of each epoch's
first step. A checkpoint that
is unreadable, truncated or not a coop checkpoint stops the run with a one-line `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import trange

from coop import distributed
from coop.config.load import RESULT_FREE_KEYS, flatten, to_yaml
from coop.config.schema import DEFAULTS
from coop.data import DataError
from coop.io import atomic_write, write_json
from coop.model.tokenizer import check_same_tokenizer, prompt_tokenizer
from coop.model.weights import absolute_model_files, absolute_tokenizer_dir
from coop.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from coop.train.engine import (
    NonFiniteLossError,
    Setup,
    default_output_dir,
    setup,
    train_one_epoch,
)
from coop.train.evaluation import evaluate_targets, pending_evaluations, run_fields
from coop.train.lock import require_run_folder, run_lock
from coop.train.preflight import check_base_to_new, check_data_files, check_model_files, check_model_limits
from coop.train.run_features import evaluate_run, requested_features, training_features, val_features
from coop.train.schedule import Schedule, build_optimizer, plan_schedule
from coop.train.tensorboard import Board, open_board

log = logging.getLogger(__name__)

HISTORY_FIELDS = ["epoch", "loss", "train_acc", "lr", "time_s"]


class RunError(ValueError):
    """The run folder cannot be used (e.g. it holds a run with another config)."""


def attach_log_file(folder: Path, name: str = "log.txt", level: int = logging.NOTSET) -> logging.Handler:
    handler = logging.FileHandler(folder / name)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def check_same_config(old: dict, new: dict, folder: Path) -> None:
    """RunError unless `old` (the folder's run) and `new` agree on every key that changes results.

    A key that the old run's config lacks (it was added to coop later) counts as its default.
    """
    defaults = flatten(DEFAULTS)
    a, b = {**defaults, **flatten(old)}, flatten(new)
    # a run saved before model files were recorded by absolute path: its relative path, from here
    a["model.name"], a["model.pretrained"] = absolute_model_files(a["model.name"], a["model.pretrained"])
    diff = [k for k in sorted(set(a) | set(b)) if k not in RESULT_FREE_KEYS and a.get(k) != b.get(k)]
    if diff:
        k = diff[0]
        raise RunError(
            f"{folder} holds a run with a different config ({k}: {a.get(k)!r} there, {b.get(k)!r} now); "
            "use another output_dir"
        )


def write_history(folder: Path, history: list[dict], fields: list[str] = HISTORY_FIELDS) -> None:
    """`history.csv`, one row per epoch (or round), written atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(history)
    atomic_write(folder / "history.csv", lambda tmp: Path(tmp).write_text(buf.getvalue()))


def train_run(cfg: DictConfig) -> dict:
    """Train (or resume, or skip if finished) the run described by `cfg`; returns its metrics."""
    check_model_files(cfg)  # before the folder is touched: the model, its weights and tokenizer are here
    check_base_to_new(cfg)  # ... a refused protocol in one line, not after training
    check_model_limits(cfg)  # ... as is a key beyond the model's towers (prompt.depth=20)
    check_data_files(cfg)  # ... and a 2SFS split file or description file that the run cannot use
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir(cfg)
    cfg.model.name, cfg.model.pretrained = absolute_model_files(cfg.model.name, cfg.model.pretrained)
    cfg.model.tokenizer = absolute_tokenizer_dir(cfg.model.tokenizer)
    folder = require_run_folder(cfg.output_dir)  # every rank, before it writes or builds anything
    world = distributed.world()  # under torchrun rank 0 alone writes the folder; rank k logs warnings
    folder.mkdir(parents=True, exist_ok=True)
    with run_lock(folder) if world.is_main else contextlib.nullcontext():  # a second run refuses in one line
        handler = attach_log_file(
            folder, world.log_name, logging.NOTSET if world.is_main else logging.WARNING
        )
        board = open_board(folder, bool(cfg.train.tensorboard) and world.is_main)
        try:
            return _train_run(cfg, folder, board)
        finally:
            board.close()
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


def _train_run(cfg: DictConfig, folder: Path, board: Board) -> dict:
    config = OmegaConf.to_container(cfg, resolve=True)
    ckpt_path, metrics_path = folder / "checkpoint.pt", folder / "metrics.json"
    ckpt = read_resume_checkpoint(ckpt_path)
    if ckpt is not None:
        check_same_config(ckpt["config"], config, folder)
        if ckpt.get("finished") and metrics_path.is_file():
            log.info("%s is finished; not training again", folder)
            metrics = json.loads(metrics_path.read_text())
            if pending_evaluations(cfg, folder):  # e.g. killed while evaluating eval.targets
                evaluate_targets(cfg, ckpt, folder, board=board)
            return metrics
    atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(to_yaml(cfg)))

    s = setup(cfg)
    method = s.method
    if method.tunes_on_val:
        require_val(s)  # before any feature is encoded
    fitted, extra = method_fit(s)  # before the optimizer: `fit` may create the trained tensors
    distributed.broadcast_tensors(method.learnable())  # one fit on every rank (a no-op in one process)
    trained = [p for p in method.learnable().values() if p.requires_grad]
    optimizer = build_optimizer(method.param_groups(), cfg.train)
    schedule = plan_schedule(cfg, len(s.dataset.train))
    schedule = replace(schedule, restart=method.restart_step(schedule.total))  # 2SFS's second stage
    start, history = restore(ckpt, s, optimizer, folder, schedule) if ckpt is not None else (0, [])
    epochs = schedule.epochs if method.trainer == "sgd" else 0
    log.info(
        "%s | %s | %s (%s) | %d classes, %d shots, seed %d | %d epochs | %d learnable parameters | %s %s",
        cfg.data.name,
        method.name,  # "maple+dept" for DePT on MaPLe
        cfg.model.name,
        cfg.model.pretrained,
        method.n_cls,
        cfg.data.shots,
        cfg.data.seed,
        epochs,
        sum(p.numel() for p in trained),
        s.device,
        s.precision,
    )
    tokenizer = prompt_tokenizer(s.clip.tokenizer).identity()  # eval and predict compare theirs with it
    if ckpt is not None:
        check_same_tokenizer(tokenizer, ckpt.get("tokenizer"), str(folder))
    state = {
        "config": config,
        "classnames": list(s.dataset.classnames),
        "tokenizer": tokenizer,
        **method.describe(),
    }

    def checkpoint(epoch: int, finished: bool) -> None:
        save_checkpoint(
            ckpt_path,
            {
                **state,
                "prompt": {k: v.detach().cpu() for k, v in method.learnable().items()},
                "method_state": method.training_state(),
                "optimizer": optimizer.state_dict(),
                "lr_schedule": schedule.name,
                "epoch": epoch,
                "finished": finished,
                "history": history,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            },
        )

    if method.trainer == "sgd":
        fit(s, optimizer, schedule, start, history, checkpoint, folder, board)
    if method.tunes_on_val:
        # every rank tunes on the same gathered features; rank 0's choice wins over BLAS rounding
        extra.update(distributed.broadcast(tune_on_val(s, fitted)))
        distributed.broadcast_tensors(method.learnable())
    metrics = finalize(s, epochs, history, metrics_path, extra)
    board.evaluation("test", metrics, step=epochs)
    state.update(method.describe())  # what the fit and the tuning chose, e.g. the linear probe's C
    checkpoint(epochs, finished=True)
    distributed.barrier()  # the other ranks read the checkpoint that rank 0 has just written
    if pending_evaluations(cfg, folder):
        evaluate_targets(cfg, read_resume_checkpoint(ckpt_path), folder, s.clip, board)
    return metrics


def restore(ckpt: dict, s: Setup, optimizer, folder: Path, schedule: Schedule) -> tuple[int, list[dict]]:
    """Load a checkpoint's prompts, optimizer and RNG state; returns (start epoch, history).

    Checkpoints written before the lr schedule restarted its cosine after warm-up trained every
    epoch >= W at another rate; such a run can only be resumed while it is still in warm-up.
    """
    start, warmup = int(ckpt["epoch"]), int(s.cfg.train.warmup_epochs)
    if ckpt.get("lr_schedule") != schedule.name and warmup > 0 and start > warmup:
        raise RunError(
            f"{folder} was trained for {start} epochs under an older lr schedule (its cosine did not "
            "restart after warm-up); use another output_dir"
        )
    s.method.load_trained(ckpt["prompt"], ckpt["classnames"])
    s.method.load_training_state(ckpt.get("method_state", {}))
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    log.info("resuming %s from epoch %d", folder, start)
    return start, list(ckpt["history"])


def fit(
    s: Setup,
    optimizer,
    schedule: Schedule,
    start: int,
    history: list[dict],
    checkpoint,
    folder: Path,
    board: Board,
) -> None:
    """Train epochs start..epochs-1, appending to `history` (and `board`), checkpointing after each."""
    tensors, epochs = list(s.method.learnable().values()), schedule.epochs
    train_feats = training_features(s) if start < epochs else None
    log_every = max(1, epochs // 10)
    bar = trange(start, epochs, initial=start, total=epochs, desc="epochs", dynamic_ncols=True)
    for epoch in bar:
        t0 = time.perf_counter()
        lr = schedule.apply(optimizer, epoch)
        kept = (
            f"the last good checkpoint is {folder / 'checkpoint.pt'} (epoch {epoch})"
            if epoch
            else "no checkpoint was written"
        )
        try:
            stats = train_one_epoch(s, optimizer, epoch, train_feats, schedule)
        except NonFiniteLossError as e:
            raise NonFiniteLossError(f"{e}; {kept}") from None
        if not all(torch.isfinite(p).all() for p in tensors):
            raise NonFiniteLossError(f"prompt parameters became non-finite in epoch {epoch + 1}; {kept}")
        s.method.end_epoch(epoch + 1, epochs)  # e.g. PromptSRC's aggregation, stored by the checkpoint
        row = {"epoch": epoch + 1, **{k: round(v, 6) for k, v in stats.items()}, "lr": lr}
        history.append({**row, "time_s": round(time.perf_counter() - t0, 3)})
        checkpoint(epoch + 1, finished=False)
        write_history(folder, history)
        board.epoch(row)
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


def method_fit(s: Setup) -> tuple[tuple | None, dict]:
    """The method's `fit` on the training features it requests (`Method.fit_request`), if any.

    Returns:
        (those features ((V, N, E), labels) or None, the extra metrics `fit` returned).
    """
    request = s.method.fit_request
    if request is None:
        return None, {}
    train = requested_features(s, request)
    return train, s.method.fit(train)


def require_val(s: Setup) -> None:
    """DataError unless the run's dataset has a val split for the method's `tune`."""
    if not s.dataset.val:
        raise DataError(
            f"method={s.cfg.method} chooses its hyper-parameters on the val split, and {s.cfg.data.name} has none"
        )


def tune_on_val(s: Setup, train) -> dict:
    """The method's `tune` on the val split's features (never the test split's): the linear
    probe's C, Tip-Adapter's alpha and beta. Returns what it chose, for metrics.json."""
    require_val(s)
    val, val_labels = val_features(s)
    return s.method.tune(train, (val[0], val_labels))


def finalize(
    s: Setup, epochs: int, history: list[dict], metrics_path: Path, extra: dict | None = None
) -> dict:
    """Evaluate on the test split and write `metrics.json`."""
    metrics = evaluate_run(s)
    metrics.update(run_fields(s.cfg, s.method, epochs, history), **(extra or {}))
    write_json(metrics_path, metrics)
    log.info(
        "test accuracy %.2f%% (macro F1 %.2f) on %d images -> %s",
        metrics["accuracy"],
        metrics["macro_f1"],
        metrics["n_test"],
        metrics_path,
    )
    return metrics
