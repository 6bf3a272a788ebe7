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

import json
import logging
import shlex
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from coop.config.load import load_config
from coop.federated import ray_pool, task
from coop.federated.client import handle_evaluate, handle_query, handle_train
from coop.federated.server import run_server
from coop.io import atomic_write

log = logging.getLogger(__name__)

ray_pool.install()  # in flwr-simulation: a lost Ray actor fails one client's message, and is replaced

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


def write_result(path: str, result: dict) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(result)))


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    logging.getLogger("coop").setLevel(logging.INFO)  # progress lines to log.txt, as tools/federated.py
    run_config = context.run_config
    tool, result_file = int(run_config.get("tool-pid", 0) or 0), str(run_config.get("result-file", "") or "")
    if tool > 0:  # the one-machine simulation (coop.federated.simulation)
        # Flower's own lines go to flower.log through its handler, not to log.txt and the console:
        # its per-round INFO lines repeat ours, and for a failed client (its traceback) the server
        # logs one line
        flwr_log = logging.getLogger("flwr")
        flwr_log.setLevel(logging.WARNING)
        flwr_log.propagate = False
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
