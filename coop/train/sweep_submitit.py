"""A sweep's runs as submitit jobs: SLURM (one array job) or submitit's local executor.

    run_submitit(runs, [train_command(r, TRAIN, None) for r in runs], args, root)

`args` are tools/sweep.py's options (--executor, --jobs, --timeout-min, --gpus-per-node,
--gpus-per-run, --cpus-per-task, --partition, --no-wait). Each job runs `coop.train.sweep.run_command`,
which writes the run's `sweep.log`; a failed job (timeout, preemption) is recorded on its run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from coop.config.checks import ConfigError
from coop.train.sweep import Run, finish_run, log, run_command


def submitit_parameters(args, n_runs: int) -> dict:
    """submitit's job parameters: one task per job, which runs `train.py` itself or, with
    `--gpus-per-run N`, torchrun with N ranks on the job's N GPUs."""
    cluster, per_run = args.executor, getattr(args, "gpus_per_run", 1)
    if args.gpus_per_node is not None:
        gpus = args.gpus_per_node
    else:
        gpus = per_run if per_run > 1 else (1 if cluster == "slurm" else 0)
    params = {
        "timeout_min": args.timeout_min,
        "gpus_per_node": gpus,
        "tasks_per_node": 1,
        "name": "coop-sweep",
    }
    if args.cpus_per_task:
        params["cpus_per_task"] = args.cpus_per_task
    if cluster == "slurm":
        if args.partition:
            params["slurm_partition"] = args.partition
        params["slurm_array_parallelism"] = args.jobs or n_runs
    return params


def run_submitit(runs: list[Run], cmds: list[list[str]], args, root: Path) -> None:
    """Submit each run as a submitit job (SLURM or submitit's local executor) and wait for them."""
    try:
        import submitit
    except ImportError:
        raise ConfigError("--executor slurm/local needs submitit: pip install 'coop[slurm]'") from None
    cluster = args.executor
    executor = submitit.AutoExecutor(folder=root / ".submitit", cluster=cluster)
    executor.update_parameters(**submitit_parameters(args, len(runs)))
    cwd = os.getcwd()
    pending = list(zip(runs, cmds, strict=True))
    # SLURM: one array job, throttled by SLURM; local executor: at most --jobs at a time.
    window = len(pending) if cluster == "slurm" else (args.jobs or 1)
    active: dict = {}
    with (
        logging_redirect_tqdm(),
        tqdm(total=len(runs), desc=f"{cluster} jobs", unit="run", disable=None) as bar,
    ):
        try:
            while pending or active:
                batch, pending = pending[: window - len(active)], pending[window - len(active) :]
                if batch:
                    with executor.batch():
                        submitted = [
                            (executor.submit(run_command, c, str(r.folder / "sweep.log"), cwd), r)
                            for r, c in batch
                        ]
                    for job, run in submitted:
                        log.info("submitted job %s: %s", job.job_id, run.folder)
                        active[job] = run
                    if cluster == "slurm" and args.no_wait:
                        return
                for job in [j for j in active if j.done()]:
                    run = active.pop(job)
                    try:
                        finish_run(run, job.result())
                    except Exception as e:  # the job itself failed (timeout, preemption, node failure)
                        finish_run(run, -1, f"job {job.job_id}: {str(e).strip().splitlines()[-1][:300]}")
                    log.info("%s %s", "ok    " if run.returncode == 0 else "FAILED", run.folder)
                    bar.update()
                if active:
                    time.sleep(0.5 if cluster == "local" else 15)
        except KeyboardInterrupt:
            if cluster == "local":
                for job in active:
                    job.cancel(check=False)
            else:
                log.warning("SLURM jobs keep running: %s", " ".join(j.job_id for j in active))
            raise
