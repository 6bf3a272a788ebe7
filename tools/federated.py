"""Federated prompt learning (PromptFL, latent domains, FedOTP, FedPGP) as a one-machine Flower simulation.

    python tools/federated.py [--config configs/federated/promptfl.yaml] [key=value ...]

Same config keys, run folders and metrics.json fields as tools/train.py, plus the fl.* keys
(coop/config/load.py). Examples:

    python tools/federated.py data.name=dtd data.root=$DATA fl.clients=10 fl.rounds=20 \\
        fl.partition=dirichlet fl.alpha=0.1
    python tools/federated.py model.name=configs/models/coop-tiny.json model.pretrained=none \\
        fl.clients=3 fl.rounds=2 data.num_workers=0          # offline smoke test

Needs `pip install 'coop[federated]'`. Rerunning the same command resumes after the last
finished round; a finished run is not repeated. Without an output_dir the run goes to
output/federated/<method>/<dataset>/<model>/shots<K>/<prompt and fl settings>/seed<S>.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop import distributed  # noqa: E402
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.model.weights import absolute_model_files, absolute_tokenizer_dir  # noqa: E402
from coop.train.lock import run_lock  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="experiment YAML (keys as in coop/config/load.py, including fl.*)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. fl.clients=5")
    ap.add_argument("--cpus-per-client", type=int, default=1, help="CPU cores per simulated client (1)")
    ap.add_argument(
        "--num-cpus", type=int, default=0,
        help="CPU cores the simulation may use in all (0: the machine's); it runs "
        "num-cpus // cpus-per-client Ray actors, each ~1 GB",
    )  # fmt: skip
    ap.add_argument(
        "--clients-per-gpu", type=int, default=1, help="simulated clients sharing one GPU on CUDA runs (1)"
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)
    if distributed.active():
        raise ConfigError(
            "tools/federated.py runs in one process (Flower simulates the clients); launch it without torchrun"
        )
    if args.cpus_per_client < 1 or args.clients_per_gpu < 1:
        raise ConfigError("--cpus-per-client and --clients-per-gpu must be >= 1")
    if args.num_cpus and args.num_cpus < args.cpus_per_client:
        raise ConfigError(f"--num-cpus {args.num_cpus} is less than --cpus-per-client {args.cpus_per_client}")
    try:
        from coop.federated import task
        from coop.federated.partition import PartitionError
        from coop.federated.server import FederatedError, finished_metrics
        from coop.federated.simulation import simulate
        from coop.train.preflight import check_model_files
    except ImportError as e:
        raise ConfigError(f"federated runs need Flower: pip install 'coop[federated]' ({e})") from None

    cfg = load_config(args.config, args.overrides, base=task.FEDERATED_BASE)
    cfg.model.name, cfg.model.pretrained = absolute_model_files(cfg.model.name, cfg.model.pretrained)
    cfg.model.tokenizer = absolute_tokenizer_dir(cfg.model.tokenizer)

    try:
        task.check_config(cfg)
        check_model_files(cfg)  # the model, its weights and tokenizer are here and fit: before the run folder
        if cfg.output_dir is None:
            cfg.output_dir = str(Path("output") / task.fl_run_name(cfg))
        metrics = finished_metrics(cfg)
        if metrics is None:
            task.client_partition(cfg, task.load_data(cfg))  # bad data or partition: fail before Ray starts
            with run_lock(cfg.output_dir):  # held for the whole run; the ServerApp runs under it
                metrics = simulate(cfg, args.cpus_per_client, args.clients_per_gpu, args.num_cpus)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    except FederatedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    keys = (
        "accuracy",
        "macro_f1",
        "n_test",
        "rounds",
        "bytes_sent",
        "seed",
        "local_accuracy",
        "novel_accuracy",
    )
    summary = {k: metrics[k] for k in keys if k in metrics}  # local/novel: personalised methods
    print(json.dumps({"output_dir": cfg.output_dir, **summary}))
    return 0


if __name__ == "__main__":
    run_cli(main)
