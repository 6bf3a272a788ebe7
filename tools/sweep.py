"""Run a grid of `tools/train.py` runs, one CoOp-style run folder per point.

    python tools/sweep.py --grid configs/ablations/position.yaml --out runs/position \\
        data.name=dtd data.root=/data --jobs 4
    python tools/sweep.py --grid configs/ablations/depth.yaml --out runs/depth --dry-run
    python tools/sweep.py --grid configs/ablations/n_ctx.yaml --out runs/nctx --slurm \\
        --partition gpu --timeout-min 240                    # one SLURM job per run (submitit)
    python tools/sweep.py --grid configs/ablations/n_ctx.yaml --out runs/nctx --slurm \\
        --gpus-per-run 4                                     # each job: torchrun, 4 ranks on 4 GPUs

A grid with `tta.method` (in the grid, an override or --config) is a grid of test-time passes
(`tools/tta.py`, docs/test_time.md), each in `OUT/<coop.config.run_names.tta_run_name(cfg)>`:

    python tools/sweep.py --grid configs/protocols/test_time_cross_dataset.yaml --out runs/tta \
        data.root=/data tta.method=[zero] data.seed=[1,2,3]

A grid file is a YAML mapping of dotted config keys (those of tools/train.py): a list is swept,
a scalar is fixed. `key=value` arguments override the file; a list value (`data.seed=[1,2]`)
sweeps. Every point is validated with `coop.config.load.load_config` and its model, weights and
tokenizer with `coop.train.preflight` before anything starts (`--dry-run` lists a point they
refuse as `refused`, with the reason, and exits 2). Each
run goes to `OUT/<coop.config.run_names.run_name(cfg)>` (swept keys that the name lacks, such as
train.lr, are appended to its settings part). Finished runs (metrics.json) are skipped,
unfinished ones resume (train.py resumes from its output_dir). Each run's console output is
appended to `<run>/sweep.log`. Failures are listed at the end (exit 1); one failing run does not
stop the others. A run's outcome is read from its folder (metrics.json), never from sweep.log: a
run that another sweep on the same root is writing is waited for, then taken as its folder says. Executors: `process` (default: N local subprocesses, one GPU each when there
are GPUs), `slurm` (submitit, `pip install coop[slurm]`), `local` (submitit's local executor).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from coop.config.checks import ConfigError  # noqa: E402
from coop.train.grid import format_value, load_grid  # noqa: E402
from coop.train.sweep import plan, run_processes, train_command, visible_gpus  # noqa: E402
from coop.train.sweep_submitit import run_submitit  # noqa: E402

log = logging.getLogger("coop.train.sweep")

TRAIN = Path(__file__).resolve().parent / "train.py"
TTA = Path(__file__).resolve().parent / "tta.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--grid", help="YAML grid file (dotted config keys; lists are swept)")
    p.add_argument("--out", required=True, help="sweep root; runs go to OUT/<run name>")
    p.add_argument("--config", help="base config file passed to every train.py run")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status, train nothing")
    p.add_argument("--jobs", type=int, default=None, help="runs at once (default 1; SLURM: no limit)")
    p.add_argument("--gpus", help="comma-separated GPU ids for --executor process (default: all visible)")
    p.add_argument("--executor", choices=("process", "slurm", "local"), default="process",
                   help="process: local subprocesses; slurm/local: submitit jobs")  # fmt: skip
    p.add_argument("--slurm", action="store_true", help="same as --executor slurm")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--timeout-min", type=int, default=24 * 60, help="submitit job time limit (minutes)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per submitit job (SLURM default 1)")
    p.add_argument("--gpus-per-run", type=int, default=1,
                   help="N > 1: each run is one torchrun of N ranks on N GPUs (docs/distributed.md)")  # fmt: skip
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per submitit job")
    p.add_argument("--no-wait", action="store_true", help="SLURM: submit and exit without waiting")
    p.add_argument("--show-output", action="store_true", help="also print the runs' output")
    p.add_argument("--train-script", default=str(TRAIN), help="training entry point (default tools/train.py)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override or sweep grid keys")
    args = p.parse_args(argv)
    if args.slurm:
        args.executor = "slurm"
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.gpus_per_run < 1:
        p.error("--gpus-per-run must be >= 1")
    return args


def sweep(args: argparse.Namespace) -> int:
    root = Path(args.out).resolve()
    grid = load_grid(args.grid, args.overrides)
    if is_test_time(grid, args.config):
        from coop.config.run_names import tta_run_name
        from coop.tta.host import tta_config

        runs = plan(grid, root, args.config, not args.dry_run, load=tta_config, name=tta_run_name)
        if args.train_script == str(TRAIN):
            args.train_script = str(TTA)
    else:
        runs = plan(grid, root, args.config, check_data=not args.dry_run)
    counts = {s: sum(r.status == s for r in runs) for s in ("done", "resume", "new", "refused")}
    summary = f"{len(runs)} runs: {counts['done']} done, {counts['resume']} to resume, {counts['new']} new"
    summary += f", {counts['refused']} refused" if counts["refused"] else ""
    refused = [r for r in runs if r.status == "refused"]
    if args.dry_run:
        for r in runs:
            values = " ".join(f"{k}={format_value(v)}" for k, v in r.swept.items())
            reason = f"  ({r.error})" if r.status == "refused" else ""
            print(f"{r.status:<7} {r.folder.relative_to(root)}  {values}{reason}".rstrip())
        print(summary)
        if refused:
            print(f"error: {len(refused)} of {len(runs)} points are refused (listed above)", file=sys.stderr)
        return 2 if refused else 0
    if refused:  # before any run folder exists
        r = refused[0]
        where = " ".join(f"{k}={format_value(v)}" for k, v in r.swept.items()) or "(single point)"
        raise ConfigError(f"point {where}: {r.error}")
    train = Path(args.train_script).resolve()
    if not train.is_file():
        raise FileNotFoundError(f"training script not found: {train}")
    log.info("%s (root %s)", summary, root)
    todo = [r for r in runs if r.status != "done"]
    cmds = [train_command(r, train, args.config, args.gpus_per_run) for r in todo]
    for r in todo:
        r.folder.mkdir(parents=True, exist_ok=True)
    if not todo:
        log.info("nothing to do: every run is finished")
        return 0
    if args.executor == "process":
        gpus = visible_gpus(args.gpus)
        jobs = args.jobs or 1
        if gpus and jobs * args.gpus_per_run > len(gpus):
            log.warning("%d jobs of %d GPUs share %d GPUs", jobs, args.gpus_per_run, len(gpus))
        log.info(
            "running %d runs, %d at a time%s", len(todo), jobs, f" on GPUs {','.join(gpus)}" if gpus else ""
        )
        run_processes(todo, cmds, jobs, gpus, args.show_output, args.gpus_per_run)
    else:
        run_submitit(todo, cmds, args, root)
        if args.no_wait and args.executor == "slurm":
            log.info("submitted %d jobs; rerun the same command later to collect or resume", len(todo))
            return 0
    failed = [r for r in todo if r.returncode != 0]
    log.info("%d of %d runs finished, %d failed", len(todo) - len(failed), len(todo), len(failed))
    if failed:
        print(f"{len(failed)} failed run(s):", file=sys.stderr)
        for r in failed:
            print(f"  {r.folder}  ({r.error}; log: {r.folder / 'sweep.log'})", file=sys.stderr)
        return 1
    return 0


def is_test_time(grid: dict, config: str | None) -> bool:
    """Whether the grid's points are test-time passes: `tta.method` in the grid or the config file."""
    if "tta.method" in grid:
        return True
    return config is not None and OmegaConf.select(OmegaConf.load(config), "tta.method") is not None


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the children, as on Ctrl-C
    return sweep(args)


if __name__ == "__main__":
    run_cli(main)
