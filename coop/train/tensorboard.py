"""TensorBoard event files for a run folder: `tb/` beside `history.csv`.

    board = open_board(folder, enabled=cfg.train.tensorboard)
    board.epoch(row)                  # a history.csv row: epoch, loss, train_acc, lr
    board.evaluation("test", metrics, step=epochs)
    board.close()

`tensorboard --logdir runs/` then shows every run under `runs/`. The events repeat what
`history.csv`, `metrics.json` and `eval_*.json` hold; those files stay the source of tables and
plots, and a run's results never depend on whether TensorBoard is on (`train.tensorboard` is a
result-free key).

Scalars (step = 1-based epoch, or round for a federated run):

| tag | when |
|---|---|
| `train/loss`, `train/accuracy`, `train/lr` | every epoch (every round: the clients' mean) |
| `<split>/accuracy`, `<split>/macro_f1` | every evaluation: `test` for the run's own test split, `test_<dataset>` for an `eval.targets` entry (`test_<dataset>_new` for the new classes of base-to-new); every round for a federated run |
| `comm/bytes_sent` | every federated round |

`tensorboard` is an optional dependency (`pip install 'coop[tensorboard]'`); without it the
board is off and the log says so in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

TB_DIR = "tb"


class Board:
    """Writes a run's scalars to `log_dir`; every method is a no-op when off (`log_dir` None).

    The event file is created at the first point, so a finished run that is run again (and
    writes nothing) leaves no empty event file behind.
    """

    def __init__(self, log_dir: Path | None = None, writer_cls=None):
        self.log_dir, self.writer_cls, self.writer = log_dir, writer_cls, None

    @property
    def on(self) -> bool:
        return self.log_dir is not None

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        """Write each `tag: value` (None values are skipped) at `step`, then flush to disk."""
        if self.log_dir is None:
            return
        if self.writer is None:
            self.writer = self.writer_cls(log_dir=str(self.log_dir))
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()  # a run killed later keeps every point written so far

    def epoch(self, row: dict) -> None:
        """One `history.csv` row of a training run: `epoch`, `loss`, `train_acc`, `lr`."""
        self.scalars(
            {"train/loss": row["loss"], "train/accuracy": row["train_acc"], "train/lr": row["lr"]},
            int(row["epoch"]),
        )

    def round(self, row: dict) -> None:
        """One `history.csv` row of a federated run (its round's training and central evaluation)."""
        self.scalars(
            {
                "train/loss": row.get("train_loss"),
                "train/accuracy": row.get("train_acc"),
                "train/lr": row.get("lr"),
                "test/accuracy": row.get("accuracy"),
                "test/macro_f1": row.get("macro_f1"),
                "comm/bytes_sent": row.get("bytes_sent"),
            },
            int(row["round"]),
        )

    def evaluation(self, split: str, metrics: dict, step: int) -> None:
        """Accuracy and macro-F1 of one evaluation, under `<split>/` (e.g. `test`, `test_dtd`)."""
        self.scalars(
            {f"{split}/accuracy": metrics.get("accuracy"), f"{split}/macro_f1": metrics.get("macro_f1")},
            step,
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


OFF = Board()  # a board that writes nothing


def open_board(folder: str | Path, enabled: bool = True) -> Board:
    """A `Board` writing to `<folder>/tb/`, or one that is off.

    Args:
        folder: the run folder.
        enabled: `train.tensorboard`. When True but `tensorboard` is not installed, the board is
            off and one log line says so.
    """
    if not enabled:
        return Board()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info(
            "TensorBoard is off: the tensorboard package is not installed (pip install 'coop[tensorboard]')"
        )
        return Board()
    path = Path(folder) / TB_DIR
    log.debug("TensorBoard events -> %s", path)
    return Board(path, SummaryWriter)
