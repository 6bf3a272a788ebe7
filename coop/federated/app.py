"""The Flower apps. `coop.federated.simulation.simulate` runs them on one machine; for a real
deployment they run on a SuperLink and SuperNodes (`flwr run`):

    server_app   ServerApp; reads the run config keys `config` (a YAML file, "" for the defaults)
                 and `overrides` (space-separated key=value, as on the tools' command line);
                 `tool-pid` and `result-file` are set by `simulate` (0 and "" otherwise)
    client_app   ClientApp; each SuperNode needs `--node-config "partition-id=<k> num-partitions=<n>"`
                 and may add `data-root="<folder>"` and `device="cuda:0"` for its own machine, and
                 (FedOTP, FedPGP) `state-dir="<folder>"` for its personal tensors
                 (`coop.federated.client_state`; default <output_dir>/clients/client<k>)

Messages: QUERY (which partition does a node hold) once per server start, then TRAIN per round;
personalised methods add EVALUATE to every client per round (its personal model on its own test set).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shlex
import signal
import threading
import time
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from coop.config import load_config
from coop.federated import task
from coop.federated.client import handle_evaluate, handle_query, handle_train
from coop.federated.server import run_server
from coop.io import atomic_write

log = logging.getLogger(__name__)

client_app = ClientApp()
client_app.query()(handle_query)
client_app.train()(handle_train)
client_app.evaluate()(handle_evaluate)


def deployment_config(run_config: dict) -> DictConfig:
    """The run config of a deployed ServerApp: `config` file and `overrides` from Flower's run config."""
    path = str(run_config.get("config", "") or "") or None
    cfg = load_config(path, shlex.split(str(run_config.get("overrides", ""))), base=task.FEDERATED_BASE)
    task.check_config(cfg)
    if cfg.output_dir is None:
        cfg.output_dir = f"output/{task.fl_run_name(cfg)}"
    return cfg


server_app = ServerApp()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs: os.kill's answer
        return True


def wait_for_exit(pid: int, period: float = 0.1) -> None:
    """Return when process `pid` has ended: at once through a pidfd on Linux (readable when the
    process exits, reaped or not), else by polling `alive` every `period` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, or already gone
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while alive(pid):
        time.sleep(period)


def exit_with(pid: int, period: float = 0.1) -> None:
    """Stop this process as soon as process `pid`, the tool that started the run, is gone: a killed
    tool stops its run. Nothing is cleaned up (the run folder is only ever written atomically), and the
    process group goes too: Flower starts this process in a group of its own with the SuperExec and
    the Ray processes, which would otherwise outlive it."""

    try:
        tool_group = os.getpgid(pid)  # read now: once the tool is reaped it cannot be asked
    except OSError:
        tool_group = None

    def watch() -> None:
        wait_for_exit(pid, period)
        group = os.getpgrp()
        if group not in (tool_group, None):  # never the tool's own group (a shell's job, a test's)
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="coop-tool-watch").start()


def write_result(path: str, result: dict) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(result)))


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    logging.getLogger("coop").setLevel(logging.INFO)  # progress lines to log.txt, as tools/federated.py
    run_config = context.run_config
    tool, result_file = int(run_config.get("tool-pid", 0) or 0), str(run_config.get("result-file", "") or "")
    if tool > 0:  # the one-machine simulation (coop.federated.simulation)
        exit_with(tool)
        logging.getLogger("flwr").setLevel(logging.WARNING)  # its per-round INFO lines duplicate ours
    try:
        metrics = run_server(grid, deployment_config(run_config), lock_holder=tool or None)
    except Exception as e:
        if result_file:  # `simulate` raises it again in the tool, with its class and one line
            message = (str(e).strip().splitlines() or [""])[0]
            write_result(
                result_file, {"error": message, "type": type(e).__name__, "module": type(e).__module__}
            )
        raise
    if result_file:
        write_result(result_file, {"metrics": metrics})
