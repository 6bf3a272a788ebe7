"""The Flower apps, and the one-machine simulation that runs them.

    from coop.federated.app import simulate
    metrics = simulate(cfg)                       # fl.clients simulated SuperNodes (Ray backend)

For a real deployment the same apps run on a SuperLink and SuperNodes (`flwr run`):

    server_app   ServerApp; reads the run config keys `config` (a YAML file, "" for the defaults)
                 and `overrides` (space-separated key=value, as on the tools' command line)
    client_app   ClientApp; each SuperNode needs `--node-config "partition-id=<k> num-partitions=<n>"`
                 and may add `data-root=<folder>` and `device=<cuda:0>` for its own machine

Messages: QUERY (which partition does a node hold) once per server start, then TRAIN per round.
"""

from __future__ import annotations

import logging
import shlex

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from coop.config import load_config
from coop.federated import task
from coop.federated.client import handle_evaluate, handle_query, handle_train
from coop.federated.server import FederatedError, run_server

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


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    logging.getLogger("coop").setLevel(logging.INFO)  # progress lines to log.txt, as tools/federated.py
    run_server(grid, deployment_config(context.run_config))


def backend_config(cfg: DictConfig, cpus_per_client: float = 1.0, clients_per_gpu: int = 1) -> dict:
    """Ray resources per simulated client: CPUs, and 1/clients_per_gpu of a GPU on CUDA runs."""
    gpus = 0.0
    if task.resolve_device(cfg.device).type == "cuda":
        gpus = 1.0 / max(1, int(clients_per_gpu))
    return {
        "client_resources": {"num_cpus": float(cpus_per_client), "num_gpus": gpus},
        "init_args": {"logging_level": "ERROR"},
    }


class HeldWarnings(logging.Filter):
    """Holds the warnings that Flower logs before the ServerApp starts, for the run's log.txt.

    `run_simulation` logs its own deprecation before our ServerApp runs, so before the run folder's
    log.txt exists; left alone it reached the console twice (Flower's handler and the root's) and
    log.txt never. Held here, `run_server` logs each once to both. Nothing is dropped: `release`
    hands over every held message and lets later records through.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: list[str] | None = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.held is None or record.levelno < logging.WARNING:
            return True
        self.held.append(" ".join(record.getMessage().split()))  # Flower's multi-line text on one line
        return False

    def release(self) -> list[str]:
        held, self.held = self.held or [], None
        return held


def simulate(cfg: DictConfig, cpus_per_client: float = 1.0, clients_per_gpu: int = 1) -> dict:
    """Run `cfg` as a Flower simulation with fl.clients SuperNodes; returns metrics.json's content.

    This uses `flwr.simulation.run_simulation`, which Flower 1.42 deprecates in favour of `flwr run`
    against a local SuperLink; docs/federated.md says why we keep it and what a move needs. Its
    deprecation warning is logged once, in log.txt and on the console (HeldWarnings).
    """
    from flwr.simulation import run_simulation

    result: dict = {}
    app = ServerApp()
    flower = logging.getLogger("flwr")
    held = HeldWarnings()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        result.update(run_server(grid, cfg, notes=held.release()))

    flower.setLevel(logging.WARNING)  # its per-round INFO lines duplicate ours
    flower.addFilter(held)
    try:
        run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=int(cfg.fl.clients),
            backend_config=backend_config(cfg, cpus_per_client, clients_per_gpu),
        )
    finally:
        flower.removeFilter(held)
        for note in held.release():  # the ServerApp never started: the console still gets them
            log.warning("Flower: %s", note)
    if not result:
        raise FederatedError(f"the simulation ended without results; see {cfg.output_dir}/log.txt")
    return result
