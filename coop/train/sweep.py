"""Sweeps: expand a grid of config values into CoOp-style run folders and run them.

The library behind `tools/sweep.py`:

    grid = load_grid("configs/ablations/position.yaml", ["data.root=/data"])   # coop.train.grid
    runs = plan(grid, Path("runs/position"))          # validated, with folders and status
    run_processes(runs, [train_command(r, TRAIN, None) for r in runs], jobs=2, gpus=[], echo=False)

A grid (`coop.train.grid`) maps dotted config keys to a value (fixed) or a list (swept). A value the
grid FILE fixes is a protocol setting: for a method whose recipe
(`coop.config.recipes.METHOD_DEFAULTS`) sets that key, or a key that would cancel one of its entries
(`YIELDS_TO`), the recipe keeps its own value, so `configs/protocols/few_shot.yaml`'s
`prompt.n_ctx: 16` gives CoOp its 16 vectors and leaves MaPLe its 2. Swept keys and every
`key=value` of the command line apply to every method. Each point becomes
`OUT/<coop.config.run_names.run_name(cfg)>`; swept keys that the name lacks (e.g. train.lr) are
appended to its settings part. Runs execute as subprocesses of `tools/train.py` (local, one GPU per
worker) or as submitit jobs (SLURM, or submitit's local executor: `coop.train.sweep_submitit`).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.data import DATASETS
from coop.model.errors import ModelError
from coop.model.tokenizer import TokenizerError
from coop.model.weights import WeightsUnavailableError
from coop.train.grid import format_value, recipe_keys
from coop.train.lock import LOCKED, wait_for_writer
from coop.train.preflight import check_model_files, check_model_limits

log = logging.getLogger("coop.train.sweep")

# keys that coop.config.run_names.run_name spells out
NAMED_KEYS = {"data.name", "model.name", "data.shots", "prompt.n_ctx", "prompt.csc", "prompt.position",
              "prompt.depth", "data.seed", "data.subsample_classes", "method", "zeroshot.templates",
              "tta.method", "tta.views", "tta.init", "tta.augment"}  # fmt: skip
ROOTLESS = {"textile"}  # datasets bundled with a package: no data.root


@dataclass
class Run:
    overrides: list[str]  # key=value for train.py, without output_dir
    swept: dict  # the swept keys' values at this point
    folder: Path
    status: str = "new"  # new | resume | done | refused (the model, its weights or tokenizer: `error`)
    returncode: int | None = None
    error: str = ""


def _suffix(swept: dict, extra: list[str]) -> str:
    parts = []
    for key in extra:
        value = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in str(swept[key]))
        parts.append(f"{key.split('.')[-1]}{value}")
    return "_" + "_".join(parts) if parts else ""


def _data_problem(cfg) -> str:
    if cfg.data.name in ROOTLESS:
        return ""
    if cfg.data.root is None:
        return f"data.root is not set; data.name={cfg.data.name} needs the DATA folder (data.root=/path)"
    if not Path(str(cfg.data.root)).expanduser().is_dir():
        return f"data.root {cfg.data.root} is not a directory"
    return ""


def plan(
    grid: dict[str, list],
    out: Path,
    config: str | None = None,
    check_data: bool = True,
    load=load_config,
    name=run_name,
) -> list[Run]:
    """Expand the grid into runs, validate every point's config and find their folders.

    Args:
        grid: {dotted key: values} from `load_grid`; lists of more than one value are swept; a
            `coop.train.grid.Grid`'s fixed keys yield to the recipe of each point's method.
        out: sweep root folder.
        config: optional base config file passed to train.py as `--config`.
        check_data: also require an existing data.root (all datasets but the bundled textile).
        load, name: a point's config from (config, overrides) and its folder name: a training
            run's (`load_config`, `run_name`), or a test-time pass's (`coop.tta.host.tta_config`,
            `coop.config.run_names.tta_run_name`).
    Returns:
        Runs in grid order (the first key varies slowest), with their status.
    """
    keys = list(grid)
    swept_keys = [k for k in keys if len(grid[k]) > 1]
    extra = [k for k in swept_keys if k not in NAMED_KEYS]
    runs, seen, refusals = [], {}, {}
    for combo in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, combo, strict=True))
        overrides = [f"{k}={format_value(v)}" for k, v in point.items()]
        swept = {k: point[k] for k in swept_keys}
        where = " ".join(f"{k}={format_value(v)}" for k, v in swept.items()) or "(single point)"
        try:
            cfg = load(config, overrides)
            recipe = f"{cfg.method}+dept" if cfg.dept.enabled else cfg.method  # DePT's hosts have their own
            yielding = getattr(grid, "fixed", frozenset()) & recipe_keys(recipe)
            if yielding & set(point):  # the method's recipe keeps these keys
                overrides = [f"{k}={format_value(v)}" for k, v in point.items() if k not in yielding]
                cfg = load(config, overrides)
            refusal = model_refusal(cfg, refusals)
        except (ValueError, ModelError) as e:  # ConfigError, and a test-time pass's TestTimeError
            raise ConfigError(f"point {where}: {e}") from None
        if not refusal:
            try:  # a point's own limit (prompt.depth above the text tower's layers) refuses that point
                check_model_limits(cfg)
            except (ConfigError, ModelError) as e:
                refusal = str(e)
        if cfg.data.name not in DATASETS:
            raise ConfigError(f"point {where}: unknown data.name '{cfg.data.name}' ({', '.join(DATASETS)})")
        problem = _data_problem(cfg)
        if problem and check_data:
            raise ConfigError(f"point {where}: {problem}")
        head, _, seed = name(cfg).rpartition("/")
        folder = out / f"{head}{_suffix(swept, extra)}" / seed
        if folder in seen:
            raise ConfigError(
                f"points {seen[folder]} and {where} map to the same run folder {folder}; "
                "sweep keys that change the run, or make the values distinct"
            )
        seen[folder] = where
        status = "refused" if refusal else run_status(folder)
        runs.append(Run(overrides, swept, folder, status, error=refusal))
    return runs


def model_refusal(cfg, seen: dict) -> str:
    """Why this point's model, weights or tokenizer cannot run here (`check_model_files`), or "";
    `seen` keeps the answers per (model, weights, tokenizer) across a sweep's points."""
    key = (str(cfg.model.name), cfg.model.pretrained, cfg.model.tokenizer)
    if key not in seen:
        try:
            check_model_files(cfg)
            seen[key] = ""
        except (ModelError, TokenizerError, WeightsUnavailableError, FileNotFoundError) as e:
            seen[key] = str(e)
    return seen[key]


def run_status(folder: Path) -> str:
    """done (metrics.json), resume (checkpoint.pt or config.yaml) or new."""
    if (folder / "metrics.json").is_file():
        return "done"
    if (folder / "checkpoint.pt").is_file() or (folder / "config.yaml").is_file():
        return "resume"
    return "new"


def train_command(run: Run, train: Path, config: str | None, gpus_per_run: int = 1) -> list[str]:
    """The command of one run: `python train.py ...`, or with `gpus_per_run` > 1 the same under
    torchrun on one node, one rank per GPU (`coop.distributed`)."""
    cfg = ["--config", str(Path(config).resolve())] if config else []
    launch = [sys.executable]
    if gpus_per_run > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus_per_run}"]
    return [*launch, str(train), *cfg, *run.overrides, f"output_dir={run.folder}"]


def slot_gpus(gpus: list[str], slot: int, per_run: int = 1) -> str:
    """CUDA_VISIBLE_DEVICES of worker `slot` when each run takes `per_run` of `gpus`."""
    start = (slot * per_run) % len(gpus)
    return ",".join(gpus[(start + i) % len(gpus)] for i in range(per_run))


# ---------------------------------------------------------------- execution

_LIVE: set = set()  # child processes started by this sweep, terminated on Ctrl-C
_LIVE_LOCK = threading.Lock()


def _register(proc, alive: bool) -> None:
    with _LIVE_LOCK:
        (_LIVE.add if alive else _LIVE.discard)(proc)


def run_command(
    cmd: list[str], log_path: str, cwd: str, env=None, echo: bool = False, track=None, output=None
) -> int:
    """Run `cmd`, appending its stdout and stderr to `log_path` as they come; return its exit code.

    Also what each submitit job executes on its node (it touches no module state of the sweep).

    Args:
        cmd: the command.
        log_path: file the output is appended to, after a header line with the command.
        cwd: working directory (relative paths in the config resolve against it).
        env: extra environment variables.
        echo: also copy the output to this process's stdout.
        track: optional callback `track(proc, alive)` told when the child starts and ends.
        output: optional bytearray that receives the last bytes of this command's own output
            (the log may also hold another sweep's lines for the same run).
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as f:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"\n=== {stamp} sweep: {' '.join(cmd)}\n".encode())
        f.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if track:
            track(proc, True)
        try:
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
                f.write(chunk)
                f.flush()
                if output is not None:
                    output += chunk
                    del output[: -(1 << 14)]
                if echo:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
            return proc.wait()
        finally:
            if track:
                track(proc, False)


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " / ".join(ln.strip()[-200:] for ln in lines[-n:])


def _last_line(output: bytes) -> str:
    lines = [ln.strip() for ln in output.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][-200:] if lines else ""


def finish_run(run: Run, rc: int | None, error: str = "", output: bytes | None = None) -> None:
    """Record the outcome of a run's command: read from the run folder (`metrics.json`), not from
    `sweep.log`, which two sweeps on one root both append to.

    A command refused because another process is writing the folder (another sweep running the
    same point) waits for that writer, then takes the folder's outcome: finished or not.

    Args:
        run: the run.
        rc: the command's exit code (None: unknown).
        error: why it failed, when known (could not start, a job's error).
        output: the last bytes of the command's own output (`run_command(output=...)`); without
            it (a submitit job, on another node) the last line of `sweep.log`.
    """
    tail = _tail(run.folder / "sweep.log") if output is None else _last_line(output)
    if rc not in (0, None) and LOCKED in tail:
        wait_for_writer(run.folder)
        if (run.folder / "metrics.json").is_file():
            log.info("%s: finished by another process", run.folder)
            run.returncode, run.error = 0, ""
            return
        error = error or f"another process was writing it and stopped before it finished ({tail})"
    run.returncode = rc
    run.error = error
    if rc == 0 and not (run.folder / "metrics.json").is_file():
        run.returncode, run.error = -1, "train.py exited 0 but wrote no metrics.json"
    if run.returncode != 0 and not run.error:
        run.error = f"exit code {rc}: {tail or 'no output'}"


def run_processes(
    runs: list[Run], cmds: list[list[str]], jobs: int, gpus: list[str], echo: bool, gpus_per_run: int = 1
) -> None:
    """Run the commands as local subprocesses, `jobs` at a time, each worker on its own GPUs."""
    slots: queue.Queue = queue.Queue()
    for i in range(jobs):
        slots.put(i)
    cwd = os.getcwd()

    outputs = {id(r): bytearray() for r in runs}

    def work(run: Run, cmd: list[str]) -> int:
        slot = slots.get()
        try:
            env = {"CUDA_VISIBLE_DEVICES": slot_gpus(gpus, slot, gpus_per_run)} if gpus else {}
            log_path = str(run.folder / "sweep.log")
            return run_command(cmd, log_path, cwd, env, echo, _register, outputs[id(run)])
        finally:
            slots.put(slot)

    pool = ThreadPoolExecutor(max_workers=jobs)
    futures = {pool.submit(work, r, c): r for r, c in zip(runs, cmds, strict=True)}
    try:
        with (
            logging_redirect_tqdm(),
            tqdm(total=len(runs), desc="runs", unit="run", disable=True if echo else None) as bar,
        ):
            for fut in as_completed(futures):
                run = futures[fut]
                try:
                    finish_run(run, fut.result(), output=bytes(outputs[id(run)]))
                except OSError as e:
                    finish_run(run, -1, f"could not start: {e}")
                log.info("%s %s", "ok    " if run.returncode == 0 else "FAILED", run.folder)
                bar.update()
    except KeyboardInterrupt:
        with _LIVE_LOCK:
            for proc in list(_LIVE):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def visible_gpus(spec: str | None) -> list[str]:
    """GPU ids for the workers: --gpus, else CUDA_VISIBLE_DEVICES, else all GPUs torch sees."""
    if spec is not None:
        return [g for g in spec.split(",") if g.strip()]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
