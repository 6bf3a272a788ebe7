"""Optimizers and learning-rate schedules of the methods' recipes, at either granularity.

    optimizer = build_optimizer(method.param_groups(), cfg.train)
    schedule = Schedule.from_config(cfg.train, epochs, steps_per_epoch)
    schedule.apply(optimizer, epoch, step)             # before every optimizer step

`train.schedule` picks the schedule:

    cosine       Dassl's (CoOp and the methods on its code): `train.warmup_epochs` epochs at the
                 constant `train.warmup_lr`, then a cosine over `epochs` epochs whose count
                 restarts after warm-up (WARMUP_RECOUNT=True), so epoch W trains at exactly
                 `train.lr`. The rate changes once per epoch.
    cosine_iter  PyTorch's CosineAnnealingLR stepped after every iteration (CLIP-LoRA,
                 Tip-Adapter-F): step t of T trains at min_lr + (lr - min_lr)(1 + cos(pi t / T)) / 2,
                 T the run's total number of steps. Warm-up epochs, if any, run at `warmup_lr`, and
                 the count of t restarts after them as in `cosine`.
    constant     `train.lr` at every step (FedOTP, FedPGP).

Both cosines end at `train.min_lr` (0 in Dassl and Tip-Adapter-F; 1e-6 in CLIP-LoRA). A method may
split its steps in two (`Method.restart_step`, 2SFS's two stages): `cosine_iter` then runs a cosine
over the first R steps and a fresh one over the other T - R, as two CosineAnnealingLRs would. A rate
is a function of (epoch, step) alone, so a resumed run needs no scheduler state.

A method's tensors come in parameter groups (`Method.param_groups`): each group's `lr_scale`
multiplies the schedule's rate after warm-up (DePT trains its head at 6.5x the prompt rate; during
warm-up every group trains at `warmup_lr`, as Dassl's constant warm-up does), and a group may
carry its own `weight_decay`. `train.optimizer` is sgd (momentum `train.momentum`), adam or adamw
(`train.betas`, `train.eps`); every one applies `train.weight_decay` as PyTorch does (Adam: an L2
term in the gradient; AdamW: decoupled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from coop.config.checks import ConfigError, resolved_epochs

SCHEDULES = ("cosine", "cosine_iter", "constant")
OPTIMIZERS = ("sgd", "adam", "adamw")

# Stored in checkpoints under the Dassl cosine: runs saved before the cosine restarted after
# warm-up are refused past warm-up (coop.train.runner.restore).
DASSL_COSINE = "constant warm-up, then cosine restarted after warm-up (Dassl WARMUP_RECOUNT)"


def epoch_lr(
    epoch: int, *, lr: float, epochs: int, warmup_epochs: int, warmup_lr: float, min_lr: float = 0.0
) -> float:
    """The learning rate of 0-based `epoch` under CoOp's schedule, as Dassl runs it.

    Epochs e < W = `warmup_epochs` train at the constant `warmup_lr`. Then Dassl's
    CosineAnnealingLR(T_max=epochs) starts counting from zero (WARMUP_RECOUNT=True): epoch e >= W
    trains at min_lr + (lr - min_lr) * 0.5 (1 + cos(pi (e - W) / epochs)), so epoch W trains at
    exactly `lr`.
    """
    if epoch < warmup_epochs:
        return warmup_lr
    return cosine(epoch - warmup_epochs, max(epochs, 1), lr, min_lr)


def cosine(t: int, total: int, lr: float, min_lr: float) -> float:
    """CosineAnnealingLR's closed form: the rate after `t` of `total` steps."""
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t / total))


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = True) -> int:
    """Optimizer steps of one epoch over `n` items: full batches only (`train.drop_last`, as
    Dassl's few-shot loaders), or one batch of all items when there are fewer than `batch_size`;
    without drop_last (Tip-Adapter-F's loader) a last, smaller batch too."""
    if not drop_last:
        return max(1, -(-n // batch_size))
    return n // batch_size if n >= batch_size else 1


def total_steps(train_cfg, shots: int) -> int | None:
    """`train.iterations`, or `train.iterations_per_shot` x shots; None when epochs decide."""
    if train_cfg.iterations is not None:
        return int(train_cfg.iterations)
    if train_cfg.iterations_per_shot is not None:
        return int(train_cfg.iterations_per_shot) * max(int(shots), 1)
    return None


@dataclass(frozen=True)
class Schedule:
    """The learning rate of every step of a run.

    Args:
        kind: one of `SCHEDULES`.
        lr, warmup_lr, min_lr: the base, warm-up and final rates.
        epochs: epochs of the run (for `cosine`: the cosine's T_max, warm-up not subtracted).
        warmup_epochs: epochs at `warmup_lr` first.
        steps_per_epoch: optimizer steps per epoch (`steps_per_epoch`).
        steps: total optimizer steps of the run (`train.iterations`); the last epoch stops early.
        restart: `cosine_iter` restarts its cosine at this step (0: never): steps t < R follow a
            cosine over R steps, steps t >= R one over the remaining total - R.
    """

    kind: str
    lr: float
    epochs: int
    steps_per_epoch: int
    warmup_epochs: int = 0
    warmup_lr: float = 0.0
    min_lr: float = 0.0
    steps: int | None = None
    restart: int = 0

    @classmethod
    def from_config(cls, train_cfg, epochs: int, steps_per_epoch: int, steps: int | None = None) -> Schedule:
        return cls(
            kind=str(train_cfg.schedule),
            lr=float(train_cfg.lr),
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            warmup_epochs=int(train_cfg.warmup_epochs),
            warmup_lr=float(train_cfg.warmup_lr),
            min_lr=float(train_cfg.min_lr),
            steps=steps,
        )

    @property
    def name(self) -> str:
        """What a checkpoint records of the schedule."""
        if self.kind == "cosine":
            return DASSL_COSINE
        restart = f", restarted at step {self.restart}" if self.restart and self.per_step else ""
        return f"{self.kind} (min_lr {self.min_lr}, warm-up {self.warmup_epochs} epochs at {self.warmup_lr}{restart})"

    @property
    def per_step(self) -> bool:
        """Whether the rate changes within an epoch."""
        return self.kind == "cosine_iter"

    @property
    def total(self) -> int:
        """Total optimizer steps of the run."""
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps that 0-based `epoch` runs (fewer in the last epoch of an iteration budget)."""
        return max(0, min(self.steps_per_epoch, self.total - epoch * self.steps_per_epoch))

    def in_warmup(self, epoch: int) -> bool:
        """Whether 0-based `epoch` trains at the constant warm-up rate."""
        return self.kind != "constant" and epoch < self.warmup_epochs

    def apply(self, optimizer: torch.optim.Optimizer, epoch: int, step: int = 0) -> float:
        """Set every group's rate for (epoch, step); returns the schedule's rate. During warm-up
        every group trains at `warmup_lr`, whatever its `lr_scale` (Dassl's constant warm-up sets
        all groups to it); afterwards each group at the rate times its `lr_scale`."""
        lr = self.lr_at(epoch, step)
        set_lr(optimizer, lr, scaled=not self.in_warmup(epoch))
        return lr

    def lr_at(self, epoch: int, step: int = 0) -> float:
        """The rate of step `step` (0-based, within the epoch) of 0-based `epoch`."""
        if self.kind == "constant":
            return self.lr
        if epoch < self.warmup_epochs:
            return self.warmup_lr
        if self.kind == "cosine":
            return epoch_lr(
                epoch,
                lr=self.lr,
                epochs=self.epochs,
                warmup_epochs=self.warmup_epochs,
                warmup_lr=self.warmup_lr,
                min_lr=self.min_lr,
            )
        t = (epoch - self.warmup_epochs) * self.steps_per_epoch + step
        if self.restart and t >= self.restart:
            return cosine(t - self.restart, max(self.total - self.restart, 1), self.lr, self.min_lr)
        return cosine(t, max(self.restart or self.total, 1), self.lr, self.min_lr)


def plan_schedule(cfg, n_train: int) -> Schedule:
    """A run's schedule: `train.schedule` over its epochs, or over `train.iterations` steps (then
    the epochs are as many as the steps need, the last one cut short).

    Args:
        cfg: the run config.
        n_train: items in the (few-shot) train split.
    """
    train = cfg.train
    per_epoch = steps_per_epoch(n_train, int(train.batch_size), bool(train.drop_last))
    steps = total_steps(train, int(cfg.data.shots))
    epochs = resolved_epochs(cfg) if steps is None else -(-steps // per_epoch)
    if steps is not None and 0 < epochs <= int(train.warmup_epochs):
        raise ConfigError(
            f"train.warmup_epochs={train.warmup_epochs} must be less than the {epochs} epochs that "
            f"{steps} iterations take at {per_epoch} steps per epoch"
        )
    return Schedule.from_config(train, epochs, per_epoch, steps)


def build_optimizer(groups: list[dict], train_cfg) -> torch.optim.Optimizer:
    """The optimizer of `train.optimizer` over a method's parameter groups.

    Args:
        groups: `Method.param_groups()`: dicts with "params" and optionally "lr_scale" (kept in
            the group, read by `set_lr`) and "weight_decay".
        train_cfg: the run config's `train` node.
    """
    groups = [
        {**g, "params": list(g["params"]), "lr_scale": float(g.get("lr_scale", 1.0))}
        for g in groups
        if list(g["params"])
    ]
    if not groups:  # methods without parameters never step
        groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr_scale": 1.0}]
    name, lr, wd = str(train_cfg.optimizer), float(train_cfg.lr), float(train_cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=float(train_cfg.momentum), weight_decay=wd)
    betas = tuple(float(b) for b in train_cfg.betas)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(groups, lr=lr, betas=betas, eps=float(train_cfg.eps), weight_decay=wd)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, scaled: bool = True) -> None:
    """Every group trains at `lr` times its `lr_scale` (`scaled=False`: all at `lr`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * (group.get("lr_scale", 1.0) if scaled else 1.0)
