"""The server: a federated run's round loop, run folder, checkpoints and metrics.

    metrics = run_server(grid, cfg)     # inside a Flower ServerApp (simulation or deployment)

The run folder is the one `tools/train.py` writes (config.yaml, log.txt, history.csv,
checkpoint.pt, metrics.json, tb/ with train.tensorboard, and `.lock`, held while the server
writes: `coop.train.lock`), plus `partition.json` (which training items each client holds). Server and
clients run `train.precision` (`task.run_precision`); metrics.json records the one that ran.
Each round:

1. the strategy samples clients (seeded by (data.seed, round)) and sends them the global prompt
   tensors, the run config and the round's lr (`round_lr`);
2. the replies are aggregated (`coop.federated.strategy`); failed clients are logged with their
   partition id and recorded in history.csv (`failed`) and metrics.json (`client_failures`);
3. `evaluate_fn` (Flower's central evaluation signature: (round, ArrayRecord) -> MetricRecord)
   scores the new global prompt on the global test split; FedOTP and FedPGP then send EVALUATE to
   every client, which evaluates its own personal model, and average the replies
   (`coop.federated.personal`: PERSONAL_FIELDS; their `accuracy` is the global part alone);
4. `checkpoint.pt` is written atomically (global tensors, strategy state, round, history), then
   one history.csv row: round, accuracy, macro_f1, train_loss (clients' mean, weighted by their
   examples), train_acc, clients (that replied), sampled, failed, bytes_down, bytes_up,
   bytes_sent (raw global-tensor bytes of the round's messages; = down + up), lr, time_s.

Rerunning resumes after the last checkpointed round; as every random choice derives from (seed,
round, client) and the checkpoint names which version of its personal tensors each client uses
(`coop.federated.client_state`), a resumed run ends with the same tensors as an uninterrupted one
(on CPU). A finished run is not repeated. With fl.on_client_failure=stop (or when every sampled
client fails, or a client fails to evaluate) the run stops with `FederatedError` and keeps the
checkpoint of the last complete round, so the same command retries that round.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from omegaconf import DictConfig, OmegaConf

from coop.config.load import to_yaml
from coop.federated import task
from coop.federated.personal import PERSONAL_FIELDS, round_summary
from coop.federated.strategy import PromptStrategy, failure_reason
from coop.io import atomic_write, write_json
from coop.model.tokenizer import prompt_tokenizer
from coop.model.weights import load_clip
from coop.train import runner
from coop.train.checkpoint import FEDERATED_FORMAT
from coop.train.engine import evaluate
from coop.train.lock import run_lock
from coop.train.runner import check_same_config
from coop.train.tensorboard import OFF, Board, open_board

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = FEDERATED_FORMAT  # coop.train.checkpoint: tools that read run folders know it
HISTORY_FIELDS = [
    "round", "accuracy", "macro_f1", "train_loss", "train_acc", "clients", "sampled", "failed",
    "bytes_down", "bytes_up", "bytes_sent", "lr", "time_s",
]  # fmt: skip


class FederatedError(RuntimeError):
    """A federated run cannot go on (its message is one line and names the client or folder)."""


def run_server(
    grid: Grid,
    cfg: DictConfig,
    node_timeout: float = 600.0,
    round_timeout: float = 24 * 3600.0,
    lock_holder: int | None = None,
):
    """Run (or resume, or return the metrics of a finished) federated run; returns metrics.json.

    Args:
        lock_holder: the pid of the process that holds the run folder's lock for this one
            (`tools/federated.py`, whose ServerApp runs in a process that Flower starts).
    """
    folder = Path(cfg.output_dir)
    with run_lock(folder, holder=lock_holder):  # one writer per folder
        handler = runner.attach_log_file(folder)
        board = open_board(folder, bool(cfg.train.tensorboard))
        try:
            return _run(grid, cfg, folder, node_timeout, round_timeout, board)
        finally:
            board.close()
            logging.getLogger().removeHandler(handler)
            handler.close()


def read_checkpoint(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise FederatedError(
            f"cannot read checkpoint {path} ({type(e).__name__}); delete it to restart"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise FederatedError(f"{path} is not a federated coop checkpoint; use another output_dir")
    return ckpt


def write_history(folder: Path, history: list[dict], personal: bool = False) -> None:
    fields = HISTORY_FIELDS + (PERSONAL_FIELDS if personal else [])
    # rows also keep local_per_client (checkpoint, metrics.json), which the CSV leaves out
    runner.write_history(folder, [{k: r.get(k) for k in fields} for r in history], fields)


def discover_clients(grid: Grid, clients: int, timeout: float) -> dict[int, int]:
    """Wait for `clients` nodes and ask each for its partition id: {partition id: node id}."""
    deadline, last_note = time.monotonic() + timeout, 0.0
    while len(ids := list(grid.get_node_ids())) < clients:
        if time.monotonic() > deadline:
            raise FederatedError(
                f"only {len(ids)} of fl.clients={clients} nodes connected within {timeout:.0f} s"
            )
        if time.monotonic() - last_note > 10:
            log.info("waiting for nodes: %d of %d connected", len(ids), clients)
            last_note = time.monotonic()
        time.sleep(0.2)
    query = [Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=i) for i in ids]
    nodes: dict[int, int] = {}
    for reply in grid.send_and_receive(query, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise FederatedError(f"node {node} did not report its partition-id: {failure_reason(reply)}")
        metrics = reply.content["metrics"]
        pid, n = int(metrics["partition-id"]), int(metrics["num-partitions"])
        if n not in (-1, clients):
            raise FederatedError(f"node {node} has num-partitions={n}, but fl.clients={clients}")
        if not 0 <= pid < clients or pid in nodes:
            raise FederatedError(
                f"node {node} has partition-id={pid}: ids must be 0..{clients - 1}, one per node"
            )
        nodes[pid] = node
    missing = [p for p in range(clients) if p not in nodes]
    if missing:
        raise FederatedError(f"no node answered for partition-id {missing[0]} (fl.clients={clients})")
    return nodes


def finished_metrics(cfg: DictConfig) -> dict | None:
    """metrics.json of the finished run in cfg.output_dir, None if it is not finished (or new).

    Raises FederatedError if the folder holds a run with another config, or an unusable checkpoint.
    """
    folder = Path(cfg.output_dir)
    ckpt = read_checkpoint(folder / "checkpoint.pt")
    if ckpt is None:
        return None
    check_same_config(ckpt["config"], OmegaConf.to_container(cfg, resolve=True), folder)
    if ckpt.get("finished") and (folder / "metrics.json").is_file():
        log.info("%s is finished; not training again", folder)
        return json.loads((folder / "metrics.json").read_text())
    return None


class ServerRun:
    """One federated run on the server: what it holds between rounds, and its steps."""

    def __init__(self, cfg: DictConfig, folder: Path):
        self.cfg, self.folder = cfg, folder
        self.config = OmegaConf.to_container(cfg, resolve=True)
        self.device = task.resolve_device(cfg.device)
        clip = load_clip(cfg.model.name, cfg.model.pretrained, self.device, cfg.model.tokenizer)
        self.tokenizer = prompt_tokenizer(clip.tokenizer).identity()  # recorded: eval and predict compare
        self.ds = task.load_data(cfg)
        self.part = task.client_partition(cfg, self.ds)
        self.method = task.build_method(clip, self.ds.classnames, cfg).to(self.device)
        self.precision = task.run_precision(cfg, self.device)
        task.prepare_precision(clip, self.method, self.precision)  # the clients run the same
        self.test_feats, self.test_labels = task.features(
            cfg, clip, self.ds.test, self.device, train=False, what="the test split",
            tokens=self.method.image_tokens,
        )  # fmt: skip
        fl = cfg.fl
        tensors = {k: v.detach().cpu().clone() for k, v in self.method.learnable().items()}
        keys = getattr(self.method, "personal_keys", ())
        self.personal = bool(keys)  # FedOTP, FedPGP: per-client tensors, personalised metrics
        self.initial_personal = {k: tensors[k] for k in keys}  # the clients build the same
        self.strategy = PromptStrategy(
            clients=int(fl.clients),
            fraction=float(fl.fraction),
            seed=int(cfg.data.seed),
            aggregation=fl.aggregation,
            mu=float(fl.mu),
            beta=float(fl.beta),
            personal_keys=keys,
        )
        self.arrays = {k: v for k, v in tensors.items() if k not in keys}  # the global tensors
        self.round, self.history, self.failures = 0, [], []
        self.board = OFF  # TensorBoard: one point per round (coop.train.tensorboard)

    def restore(self, ckpt: dict) -> None:
        if ckpt.get("partition_digest", self.part.digest()) != self.part.digest():
            raise FederatedError(
                f"{self.folder}/checkpoint.pt was trained on another partition than this config draws now "
                "(other data or partition rule): use another output_dir"
            )
        self.arrays, self.round = dict(ckpt["prompt"]), int(ckpt["round"])
        self.history, self.failures = list(ckpt["history"]), list(ckpt["failures"])
        if self.personal and "personal_round" not in ckpt["strategy"]:  # written before they moved
            raise FederatedError(
                f"{self.folder}/checkpoint.pt keeps personal tensors on the server: use another output_dir"
            )
        self.strategy.load_state_dict(ckpt["strategy"])
        log.info("resuming %s after round %d", self.folder, self.round)

    def describe(self) -> None:
        cfg, fl, ds = self.cfg, self.cfg.fl, self.ds
        log.info(
            "%s | %s (%s) | %d classes, %d train / %d test images | %s: %d clients (%s partition, sizes %s), "
            "%d rounds x %d local epochs, %s | %d prompt parameters | %s %s",
            cfg.data.name, cfg.model.name, cfg.model.pretrained, len(ds.classnames), len(ds.train), len(ds.test),
            fl.method, fl.clients, fl.partition, self.part.sizes(), fl.rounds, fl.local_epochs, fl.aggregation,
            sum(t.numel() for t in self.arrays.values()), self.device, self.precision,
        )  # fmt: skip

    def evaluate_fn(self, server_round: int, record: ArrayRecord) -> MetricRecord:
        """Flower's central evaluation signature: the global tensors on the global test split."""
        result = self.evaluate_global(record.to_torch_state_dict())
        return MetricRecord({"accuracy": result["accuracy"], "macro-f1": result["macro_f1"]})

    def evaluate_global(self, tensors: dict, domains=None) -> dict:
        """`coop.train.engine.evaluate` of the global tensors; a personal method's global part alone."""
        if self.personal:  # the personal tensors are unused by the global-only forward
            tensors = {**self.initial_personal, **tensors}
            self.method.global_only = True
        self.method.load_learnable(tensors, self.ds.classnames)
        try:
            return evaluate(
                self.method, self.test_feats[0], self.test_labels, self.device, self.precision, domains
            )
        finally:
            if self.personal:
                self.method.global_only = False

    def personal_fields(self, grid: Grid, rnd: int, arrays: ArrayRecord, timeout: float, acc: float) -> dict:
        """Each client's personal model, evaluated by the client, averaged; `acc`: the global part's."""
        config = ConfigRecord({"coop-config": self.client_yaml, "partition-digest": self.part.digest()})
        messages = self.strategy.configure_evaluate(rnd, arrays, config, grid)
        out = self.strategy.aggregate_evaluate(rnd, grid.send_and_receive(messages, timeout=timeout))
        if out is None:
            f = self.strategy.last_eval_failures[0]
            raise FederatedError(
                f"round {rnd}: client {f['client']} could not evaluate ({f['error']}); Local averages over "
                f"every client, so the run stops and the checkpoint keeps round {rnd - 1}"
            )
        row = {k: round(float(out[k]), 4) if k in out else None for k in PERSONAL_FIELDS}
        row["global_accuracy"] = round(acc, 4)
        row["local_per_client"] = [round(a, 4) for a in out["local_per_client"]]
        return row

    def checkpoint(self, finished: bool = False) -> None:
        state = {
            "format": CHECKPOINT_FORMAT,
            "config": self.config,
            "classnames": list(self.ds.classnames),
            "tokenizer": self.tokenizer,
            "prompt": self.arrays,
            "strategy": self.strategy.state_dict(),
            "round": self.round,
            "finished": finished,
            "history": self.history,
            "failures": self.failures,
            "partition_digest": self.part.digest(),
        }
        atomic_write(self.folder / "checkpoint.pt", lambda tmp: torch.save(state, tmp))

    def play_round(self, grid: Grid, rnd: int, round_timeout: float) -> None:
        """Train, aggregate, evaluate, then checkpoint and log round `rnd`."""
        cfg, strategy, t0 = self.cfg, self.strategy, time.perf_counter()
        rounds = int(cfg.fl.rounds)
        lr = task.round_lr(rnd, rounds, float(cfg.train.lr), cfg.fl.lr_schedule)
        config = ConfigRecord(
            {"coop-config": self.client_yaml, "lr": lr, "partition-digest": self.part.digest()}
        )
        messages = strategy.configure_train(rnd, ArrayRecord(self.arrays), config, grid)
        log.info(
            "round %d/%d: training clients %s at lr %.3g", rnd, rounds, strategy.last_stats["sampled"], lr
        )
        new, train_metrics = strategy.aggregate_train(
            rnd, grid.send_and_receive(messages, timeout=round_timeout)
        )
        for f in strategy.last_failures:
            log.error("round %d: client %d failed: %s", rnd, f["client"], f["error"])
        if new is None:
            raise FederatedError(
                f"round {rnd}: every sampled client failed (first: {strategy.last_failures[0]['error']})"
            )
        if strategy.last_failures and cfg.fl.on_client_failure == "stop":
            f = strategy.last_failures[0]
            raise FederatedError(
                f"round {rnd}: client {f['client']} failed ({f['error']}); fl.on_client_failure=stop, "
                f"the checkpoint keeps round {rnd - 1}"
            )
        self.failures += strategy.last_failures
        self.arrays, self.round = new.to_torch_state_dict(), rnd
        result, stats = self.evaluate_fn(rnd, new), strategy.last_stats
        personal = (
            self.personal_fields(grid, rnd, new, round_timeout, result["accuracy"]) if self.personal else {}
        )
        row = {
            "round": rnd,
            "accuracy": round(result["accuracy"], 4),
            "macro_f1": round(result["macro-f1"], 4),
            "train_loss": round(train_metrics["train-loss"], 6),
            "train_acc": round(train_metrics["train-acc"], 4),
            "clients": stats["clients"],
            "sampled": len(stats["sampled"]),
            "failed": " ".join(str(f["client"]) for f in strategy.last_failures),
            "bytes_down": stats["bytes_down"],
            "bytes_up": stats["bytes_up"],
            "bytes_sent": stats["bytes_down"] + stats["bytes_up"],
            "lr": lr,
            "time_s": round(time.perf_counter() - t0, 3),
            **personal,
        }
        self.history.append(row)
        self.checkpoint()
        write_history(self.folder, self.history, self.personal)
        self.board.round(row)
        log.info(
            "round %d/%d: accuracy %.2f%%, train loss %.4f, %d clients, %d bytes sent (%.1f s)",
            rnd, rounds, row["accuracy"], row["train_loss"], row["clients"], row["bytes_sent"], row["time_s"],
        )  # fmt: skip
        if self.personal:
            log.info(
                "round %d/%d: local %.2f%%, base %s, novel %s, global %.2f%%", rnd, rounds, row["local_accuracy"],
                row["base_accuracy"], row["novel_accuracy"], row["global_accuracy"],
            )  # fmt: skip

    def fit(self, grid: Grid, node_timeout: float, round_timeout: float) -> None:
        rounds = int(self.cfg.fl.rounds)
        if self.round >= rounds:
            return
        self.strategy.set_nodes(discover_clients(grid, int(self.cfg.fl.clients), node_timeout))
        self.strategy.summary()
        self.client_yaml = to_yaml(task.absolute_paths(self.cfg))
        for rnd in range(self.round + 1, rounds + 1):
            self.play_round(grid, rnd, round_timeout)

    def finalize(self) -> dict:
        """Evaluate the final prompt (per class and per domain), write metrics.json."""
        cfg, method = self.cfg, self.method
        domains = task.item_domains(self.ds, self.ds.test)
        metrics = self.evaluate_global(self.arrays, domains)
        if self.personal and self.history:
            metrics.update(round_summary(self.history), local_per_client=self.history[-1]["local_per_client"])
            log.info(
                "local accuracy: final %.2f%%, last-5 mean %.2f ± %.2f; max over rounds %.2f%% "
                "(test-set selection, as the originals print it; not used)", metrics["local_accuracy"],
                metrics["local_accuracy_last5_mean"], metrics["local_accuracy_last5_std"],
                metrics["local_accuracy_max_test_selected"],
            )  # fmt: skip
        metrics.update(
            epochs=int(cfg.fl.rounds) * int(cfg.fl.local_epochs),
            rounds=int(cfg.fl.rounds),
            **task.run_fields(cfg, method),
            precision=self.precision,
            final_train_loss=self.history[-1]["train_loss"] if self.history else None,
            bytes_sent=sum(r["bytes_sent"] for r in self.history),
            client_failures=self.failures,
            domain_usage=self.strategy.domain_usage or None,
        )
        path = self.folder / "metrics.json"
        write_json(path, metrics)
        self.checkpoint(finished=True)
        log.info("test accuracy %.2f%% (macro F1 %.2f) on %d images -> %s", metrics["accuracy"],
                 metrics["macro_f1"], metrics["n_test"], path)  # fmt: skip
        return metrics


def _run(
    grid: Grid, cfg: DictConfig, folder: Path, node_timeout: float, round_timeout: float, board: Board = OFF
) -> dict:
    done = finished_metrics(cfg)
    if done is not None:
        return done
    ckpt = read_checkpoint(folder / "checkpoint.pt")
    atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(to_yaml(cfg)))
    run = ServerRun(cfg, folder)
    run.board = board
    if ckpt is not None:
        run.restore(ckpt)
    write_json(folder / "partition.json", run.part.to_json())
    run.describe()
    run.fit(grid, node_timeout, round_timeout)
    return run.finalize()
