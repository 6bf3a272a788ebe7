"""Evaluating a trained run: its test metrics' fields, `eval.targets` (other datasets, base-to-new's
new classes) and saved checkpoints (`tools/eval.py`).

    metrics = evaluate_checkpoint("output/dtd/.../seed1/checkpoint.pt", ["data.root=DATA"])
    evaluate_checkpoint_targets(path, ["imagenetv2", "imagenet_a"])   # eval_<dataset>.json beside it

Each target is scored by the method rebuilt for the target's classes with the checkpoint's
learned tensors (`Method.load_trained`); a method that cannot score other classes refuses in one
line (`TransferError`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from coop.config.load import load_config
from coop.config.run_names import model_tag
from coop.io import write_json
from coop.model.clip import CLIP
from coop.train.checkpoint import FEDERATED_FORMAT, CheckpointError, load_checkpoint
from coop.train.engine import setup
from coop.train.preflight import check_run_model
from coop.train.run_features import evaluate_run
from coop.train.tensorboard import OFF, Board

log = logging.getLogger(__name__)


def run_fields(cfg: DictConfig, method, epochs: int, history: list[dict]) -> dict:
    """The fields that describe a run in `metrics.json` and every `eval_*.json` it writes."""
    return {
        "method": cfg.method,
        "epochs": epochs,
        "shots": int(cfg.data.shots),
        "seed": int(cfg.data.seed),
        "dataset": cfg.data.name,
        "model": model_tag(cfg.model.name),
        "pretrained": cfg.model.pretrained,
        **method.describe(),
        # a training run's rows have `loss`, a federated run's rounds `train_loss`
        "final_train_loss": history[-1].get("loss", history[-1].get("train_loss")) if history else None,
    }


def targets_of(cfg: DictConfig) -> list[tuple[str, str]]:
    """(dataset, classes) a finished run is also evaluated on: `eval.targets`, and the new classes
    of a base-to-new run (`data.subsample_classes=base`)."""
    targets = [(str(name), "all") for name in cfg.eval.targets]
    if cfg.data.subsample_classes == "base":
        targets.append((cfg.data.name, "new"))
    return targets


def eval_file(dataset: str, classes: str = "all") -> str:
    """`eval_<dataset>.json`, or `eval_<dataset>_new.json` for the new classes of base-to-new."""
    return f"eval_{dataset}{'' if classes == 'all' else '_' + classes}.json"


def pending_evaluations(cfg: DictConfig, folder: Path) -> list[tuple[str, str]]:
    return [t for t in targets_of(cfg) if not (folder / eval_file(*t)).is_file()]


def evaluate_on(
    cfg: dict, ckpt: dict, dataset: str, classes: str = "all", clip: CLIP | None = None
) -> tuple[dict, CLIP]:
    """Metrics of a checkpoint's learned tensors on `dataset`'s test split (its own class list).

    Args:
        cfg: the run's config (plain dict); `dataset` and `classes` replace its data.name and
            data.subsample_classes.
        ckpt: the run's checkpoint (its learned tensors and class names).
        dataset, classes: what to evaluate on.
        clip: an already loaded CLIP of the run's model, reused across targets.

    Returns:
        (metrics with the same fields as `metrics.json` plus `trained_on`, the CLIP used).
    """
    target = load_config(None, [f"data.name={dataset}", f"data.subsample_classes={classes}"], base=cfg)
    s = setup(target, ckpt, clip=clip)
    metrics = evaluate_run(s)
    history = ckpt.get("history") or []
    metrics.update(
        run_fields(target, s.method, int(ckpt.get("epoch", 0)), history),
        subsample_classes=classes,
        trained_on=ckpt["config"]["data"]["name"],
    )
    return metrics, s.clip


def evaluate_targets(
    cfg: DictConfig, ckpt: dict, folder: Path, clip: CLIP | None = None, board: Board = OFF
) -> dict[str, dict]:
    """Evaluate every pending target of a finished run; writes `eval_<dataset>.json` into `folder`.

    Feature caches are shared between runs, so each target's test set is encoded once per model.
    """
    config = OmegaConf.to_container(cfg, resolve=True)
    results = {}
    for dataset, classes in pending_evaluations(cfg, folder):
        metrics, clip = evaluate_on(config, ckpt, dataset, classes, clip)
        path = folder / eval_file(dataset, classes)
        write_json(path, metrics)
        board.evaluation(path.stem.replace("eval_", "test_", 1), metrics, step=int(ckpt.get("epoch", 0)))
        log.info(
            "%s: accuracy %.2f%% on %d images -> %s", dataset, metrics["accuracy"], metrics["n_test"], path
        )
        results[path.name] = metrics
    return results


def load_evaluable(path: str | Path) -> dict:
    """The checkpoint at `path`, if `evaluate_on` can score it: any training run, and of federated
    runs PromptFL's (CoOp's tensors); the other federated methods are a one-line CheckpointError."""
    ckpt = load_checkpoint(path)
    fl = ckpt["config"].get("fl", {}).get("method") if ckpt.get("format") == FEDERATED_FORMAT else None
    if fl not in (None, "promptfl"):
        raise CheckpointError(
            f"{path} is a federated fl.method={fl} run, which tools/eval.py does not score: its "
            "metrics.json holds its evaluations, and tools/predict.py scores images with its models"
        )
    return ckpt


def evaluate_checkpoint(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Test accuracy of a saved run on its own dataset or, where the method transfers, another one.

    Args:
        path: a `checkpoint.pt`.
        overrides: `key=value` changes to the run's config, e.g. "data.name=dtd", "data.root=...".

    Raises:
        CheckpointError: `path` is missing, corrupt, truncated or not a coop checkpoint.
        TransferError: the learned tensors cannot score the requested classes (csc context).
        ModelError, TokenizerError, WeightsUnavailableError: the model cannot be rebuilt here, or
            with the tokenizer the run was trained with (`coop.train.preflight.check_run_model`).
    """
    ckpt = load_evaluable(path)
    cfg = load_config(None, overrides, base=ckpt["config"])
    check_run_model(cfg, ckpt.get("tokenizer"), str(path))  # before the data: model, weights, tokenizer
    metrics, _ = evaluate_on(
        OmegaConf.to_container(cfg, resolve=True), ckpt, cfg.data.name, cfg.data.subsample_classes
    )
    metrics["checkpoint"] = str(path)
    return metrics


def evaluate_checkpoint_targets(path: str | Path, targets: list[str], overrides=()) -> dict[str, dict]:
    """`eval.targets` for a saved run: each target's metrics, written beside the checkpoint."""
    ckpt = load_evaluable(path)
    cfg = load_config(None, [*overrides, f"eval.targets=[{','.join(targets)}]"], base=ckpt["config"])
    check_run_model(cfg, ckpt.get("tokenizer"), str(path))
    folder = Path(path).parent
    for dataset in targets:  # re-evaluate on request, even where a file exists
        (folder / eval_file(dataset)).unlink(missing_ok=True)
    return evaluate_targets(cfg, ckpt, folder)
