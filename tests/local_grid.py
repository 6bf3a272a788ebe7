"""Flower's Message API in one process: the ServerApp's round loop (`coop.federated.server.run_server`)
on a grid whose messages go straight to the ClientApp that `flwr run` loads (`coop.federated.app`),
without a SuperLink, Ray or another process.

    metrics = run_inprocess(folder, overrides, LocalGrid(2))

The tests of our federated logic run here; tests/test_federated_runs.py runs the real simulation.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from pathlib import Path


class LocalGrid:
    """Flower's `Grid` in one process: each message goes to the ClientApp with its node's Context
    (partition k on node k + 1). Its Contexts persist while it lives, like SuperNodes'
    (`contexts`: keep another grid's, as when only the server died); a new grid has new ones, like
    restarted client processes, whose clients then read their state files. `crash=(phase, n)`
    raises right after the n-th message of that phase ("train" or "evaluate") was handled, before
    the server sees the reply. `errors={(round, k): reason}`: client k's TRAIN message of that round
    is answered with an error reply of that reason instead, as Flower's engine answers a message
    whose Ray actor died. `seen` logs every message: phase, node, config, array keys down/up."""

    def __init__(
        self,
        n: int,
        crash: tuple[str, int] | None = None,
        contexts: dict | None = None,
        errors: dict[tuple[int, int], str] | None = None,
    ):
        from flwr.app import Context, RecordDict

        self.contexts = contexts or {
            k + 1: Context(1, k + 1, {"partition-id": k, "num-partitions": n}, RecordDict(), {})
            for k in range(n)
        }
        self.crash, self.errors, self.handled, self.seen = crash, errors or {}, defaultdict(int), []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        from coop.federated.app import client_app

        replies = []
        for m in messages:
            phase, node = m.metadata.message_type, m.metadata.dst_node_id
            config = dict(m.content["config"]) if "config" in m.content else {}
            reason = self.errors.get((config.get("server-round"), node - 1)) if phase == "train" else None
            if reason is None:
                reply = client_app(m, self.contexts[node])
            else:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=m)
            up = reply.content if reply.has_content() else {}  # an error reply has none
            keys = {
                d: set(r["arrays"].keys()) if "arrays" in r else set()
                for d, r in (("down", m.content), ("up", up))
            }
            self.seen.append({"phase": phase, "node": node, "config": config, **keys})
            self.handled[phase] += 1
            if self.crash == (phase, self.handled[phase]):
                raise KeyboardInterrupt("killed")  # the server dies inside the round
            replies.append(reply)
        return replies


@contextlib.contextmanager
def flower_identity():
    """Inside the block this process has the task identity of a ServerApp's process, which Flower's
    messages read (run 1, node 0, task 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_inprocess(folder: Path, overrides: list[str], grid: LocalGrid) -> dict:
    """The federated run of `overrides` in `folder` on `grid`, logging to log.txt as the tool does;
    returns its metrics.json."""
    from coop.config.load import load_config
    from coop.federated import task
    from coop.federated.server import run_server

    cfg = load_config(None, [*overrides, f"output_dir={folder}"], base=task.FEDERATED_BASE)
    task.check_config(cfg)
    logger = logging.getLogger("coop")
    level = logger.level
    logger.setLevel(logging.INFO)  # progress lines to log.txt, as tools/federated.py sets it
    try:
        with flower_identity():
            return run_server(grid, cfg)
    finally:
        logger.setLevel(level)
