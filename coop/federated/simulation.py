"""The one-machine simulation: our Flower apps through `flwr run`, on a SuperLink of our own.

    metrics = simulate(cfg)       # fl.clients simulated SuperNodes; returns metrics.json's content

Flower's current simulation entry point is `flwr run APP CONNECTION` against a SuperLink started
with `--simulation`: the SuperLink starts a SuperExec, which starts one `flwr-simulation` process
per run; that process runs the ServerApp and the Ray backend that simulates the SuperNodes.
`simulate` gives each call a SuperLink of its own, so that the run behaves like one command:

- **its own SuperLink**, a child of this process on a free port, with a private `FLWR_HOME` (a
  temporary folder holding the connection and the installed app) and an in-memory database, so
  parallel runs never share one.
- **no process of the run outlives the tool**: every process of the run carries a marker in its
  environment, and a reaper (`coop.federated.reaper`, a process of its own) SIGKILLs them all when
  the run ends or the tool dies, however it dies; so a killed tool leaves nothing writing its run
  folder, and a rerun resumes. (The kernel also kills the SuperLink and `flwr run`, this process's
  children, when it dies: `PR_SET_PDEATHSIG`.)
- **the lock stays with the tool**: this process holds the run folder's lock for the whole run; the
  ServerApp checks that the lock's holder is its tool (`coop.train.lock.run_lock(..., holder=pid)`).
- **one config**: the resolved config is written to a file that the ServerApp loads unchanged
  (run config `config`); the SuperLink and the run start in this process's working directory, so
  relative paths mean what they mean here.
- **results and errors come back as a file** (run config `result-file`): metrics.json's content,
  or the exception's class and one-line message, which `simulate` raises again here.
- **the console** gets the run's log.txt as it grows; everything Flower prints (the SuperLink, the
  run's log stream, Ray) goes to the run folder's `flower.log`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from coop.config.load import to_yaml
from coop.federated import reaper, task
from coop.federated.server import FederatedError

APP_DIR = Path(__file__).resolve().parents[2] / "configs" / "federated" / "flower-app"
CONNECTION = "coop-local"
START_TIMEOUT = 120.0  # seconds for the SuperLink to answer


def _bin(name: str) -> str:
    """A Flower executable of this Python's environment (PATH if it is not next to it)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.is_file() else name


# libc's prctl, looked up here: between fork and exec (where the tool's threads may hold locks)
# the child only calls it
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Ask Linux to SIGKILL this child when its parent dies (PR_SET_PDEATHSIG = 1)."""
    _PRCTL(1, signal.SIGKILL)


CHILD = {"preexec_fn": _die_with_parent} if _PRCTL is not None else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resources(cfg: DictConfig, cpus_per_client: int, clients_per_gpu: int) -> dict:
    """The simulation's per-client resources: whole CPUs (Flower's simulation config holds an
    unsigned integer), and 1/clients_per_gpu of a GPU on CUDA runs (a fraction is allowed)."""
    gpus = 0.0
    if task.resolve_device(cfg.device).type == "cuda":
        gpus = 1.0 / max(1, int(clients_per_gpu))
    return {"num-cpus": int(cpus_per_client), "num-gpus": gpus}


def _answers(proc: subprocess.Popen, port: int) -> bool:
    """Wait until the SuperLink `proc` accepts connections on `port` (False: it exited first)."""
    deadline = time.monotonic() + START_TIMEOUT
    while proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise FederatedError(f"Flower's SuperLink did not start within {START_TIMEOUT:.0f} s")
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def superlink(home: Path, env: dict, flower_log) -> Iterator[str]:
    """A simulation SuperLink of our own, on a free port; yields its address, stops it on exit.
    A SuperLink that exits before it answers (another process took the port in between) is
    started again on another port, up to 3 times."""
    for attempt in range(3):
        port = free_port()
        cmd = [
            _bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
            "--database", ":flwr-in-memory:", "--host", "127.0.0.1", "--port", str(port),
            "--disable-runtime-dependency-installation",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=flower_log, stderr=subprocess.STDOUT, **CHILD)
        if _answers(proc, port):
            break
        if attempt == 2:
            raise FederatedError(
                f"Flower's SuperLink exited with code {proc.returncode} before it started; "
                f"see {flower_log.name}"
            )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()  # its state is in memory, nothing to keep; its SuperExec watches it and stops
            proc.wait()


class LogTail(threading.Thread):
    """Copies the lines that a file gains to this process's stderr, until `stop`."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.done = path, threading.Event()
        self.offset = path.stat().st_size if path.is_file() else 0

    def copy(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        if end:
            sys.stderr.write(data[:end].decode(errors="replace"))
            sys.stderr.flush()
            self.offset += end

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.copy()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.copy()


def submit(cmd: list[str], env: dict, flower_log, result_file: Path, grace: float = 0.5) -> int | None:
    """Run `flwr run ... --stream` until it ends, or until the ServerApp has written its result and
    `grace` seconds have passed: Flower then still shuts its Ray backend down for several seconds,
    which this process need not wait for (the run folder is complete, and the reaper ends the run's
    processes, `coop.federated.reaper.reaped`). Returns flwr's exit code (None if it was stopped)."""
    proc = subprocess.Popen(cmd, env=env, stdout=flower_log, stderr=subprocess.STDOUT, **CHILD)
    try:
        done_at = None
        while proc.poll() is None:
            if done_at is None and result_file.is_file():
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > grace:
                return None
            time.sleep(0.1)
        return proc.returncode
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def raise_remote(result: dict) -> None:
    """Raise here the error that the ServerApp reported ({"error", "type", "module"}): the same class
    where it can be built from its message (so the tools treat it as they would in-process)."""
    message = result["error"]
    cls = getattr(sys.modules.get(result.get("module", "")), result.get("type", ""), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            error = cls(message)
        except Exception:  # noqa: BLE001 - a class that needs other arguments
            error = None
        if error is not None and str(error) == message:
            raise error
    raise FederatedError(f"{result.get('type', 'error')}: {message}")


def simulate(cfg: DictConfig, cpus_per_client: int = 1, clients_per_gpu: int = 1, num_cpus: int = 0) -> dict:
    """Run `cfg` as a Flower simulation with fl.clients SuperNodes; returns metrics.json's content.
    Ray runs num_cpus // cpus_per_client actors (num_cpus 0: all the machine's cores), which run the
    clients' messages.

    The caller holds the run folder's lock (`coop.train.lock.run_lock`); the ServerApp runs under it.
    """
    if not (APP_DIR / "pyproject.toml").is_file():
        raise FederatedError(
            f"the Flower App {APP_DIR} is missing: run from a checkout of the repository (pip install -e)"
        )
    folder = Path(cfg.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    res = resources(cfg, cpus_per_client, clients_per_gpu)
    with (
        tempfile.TemporaryDirectory(prefix="coop-flower-", ignore_cleanup_errors=True) as tmp,
        (folder / "flower.log").open("ab") as flower_log,
    ):
        home = Path(tmp)
        # the SuperExec looks for a new run every second by default: 0.1 s starts ours sooner
        marker = f"{os.getpid()}-{secrets.token_hex(8)}"
        env = {**os.environ, "FLWR_HOME": str(home), "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}
        env[reaper.RUN_VAR] = marker  # inherited by every process of the run, Ray's included
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        (home / "config.yaml").write_text(to_yaml(cfg))
        result_file = home / "result.json"
        flower_log.write(
            f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} simulate, pid {os.getpid()}\n".encode()
        )
        flower_log.flush()
        tail = LogTail(folder / "log.txt")
        with reaper.reaped(marker), superlink(home, env, flower_log) as address:
            (home / "config.toml").write_text(
                f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                f'[superlink.{CONNECTION}]\naddress = "{address}"\ninsecure = true\n'
            )
            run_config = (
                f'config="{home / "config.yaml"}" overrides="" tool-pid={os.getpid()} '
                f'result-file="{result_file}"'
            )
            federation = (
                f"num-supernodes={int(cfg.fl.clients)} client-resources-num-cpus={res['num-cpus']} "
                f"client-resources-num-gpus={res['num-gpus']}"
            ) + (f" init-args-num-cpus={int(num_cpus)}" if num_cpus else "")
            cmd = [_bin("flwr"), "run", str(APP_DIR), CONNECTION, "--stream",
                   "--run-config", run_config, "--federation-config", federation]  # fmt: skip
            tail.start()
            try:
                code = submit(cmd, env, flower_log, result_file)
            finally:
                tail.stop()
        if not result_file.is_file():
            raise FederatedError(
                f"the simulation ended without results (flwr run exited with code {code}); "
                f"see {folder / 'log.txt'} and {folder / 'flower.log'}"
            )
        result = json.loads(result_file.read_text())
    if "error" in result:
        raise_remote(result)
    return result["metrics"]
