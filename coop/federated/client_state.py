"""A personalised client's own tensors between rounds (FedOTP's `local.ctx`, FedPGP's `U`, `V`).

    store = PersonalStore(context.state, state_dir(cfg, node_config, pid), pid, run_digest(text))
    personal = store.load(rnd, initial)     # the version the server names (0: the initial value)
    store.save(rnd, personal)               # after training in round rnd: file + context.state
    store.prune(loaded)                     # drop the files older than the version loaded

The personal tensors never travel: they live with the client, twice.

- **`Context.state`** (Flower's per-node RecordDict, kept by the simulation or the SuperNode between
  messages): an ArrayRecord `personal` and a ConfigRecord `personal-meta` (round, run); the fast path.
- **One file per round trained**, `<state dir>/personal_round<r>.pt`, written atomically
  (`coop.io.atomic_write`; loads with `weights_only=True`): what a restarted process reads, since
  `Context.state` lives in memory and a SIGKILL loses it. The state dir is the node-config
  `state-dir` if given (a deployment: the SuperNode's own disk, one folder per SuperNode), else
  `<output_dir>/clients/client<k>` (the one-machine simulation).

**Which version** a client uses is not its own choice: every TRAIN and EVALUATE message names it
(`personal-round`), and the server takes it from its checkpoint (`PromptStrategy.personal_round`:
the last round whose TRAIN reply from this client the server accepted; 0 = never trained). A client
may have written round r's file and then the server died before checkpointing round r; the
resumed server asks for the older version again, so the run replays bit-identically instead of
training on from tensors the checkpoint does not know. That is also why a client deletes only
files older than the version it loaded: the server can never ask for those again.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from coop.io import atomic_write, refused_unpickling

FORMAT = "coop-personal-1"
ARRAYS, META = "personal", "personal-meta"  # the keys in Context.state
FILE = re.compile(r"personal_round(\d+)\.pt")


class PersonalStateError(RuntimeError):
    """A client's personal tensors cannot be read or written (one line: the round and the path)."""


def state_dir(cfg, node_config: dict, pid: int) -> Path:
    """Node-config `state-dir` if given, else `<output_dir>/clients/client<pid>` (absolute: the
    server sends `task.absolute_paths` of its config)."""
    if "state-dir" in node_config:
        return Path(str(node_config["state-dir"])).expanduser()
    if cfg.output_dir is None:
        raise PersonalStateError(
            "the run has no output_dir: give the SuperNode a node-config state-dir=<folder>"
        )
    return client_dir(str(cfg.output_dir), pid)


def client_dir(output_dir: str | Path, pid: int) -> Path:
    """Client `pid`'s state dir in a run folder (the one-machine simulation's)."""
    return Path(output_dir) / "clients" / f"client{pid}"


def run_digest(config_text: str) -> str:
    """Which run a state file belongs to: a digest of the run config the server sends."""
    return hashlib.sha256(config_text.encode()).hexdigest()[:16]


def round_file(folder: str | Path, rnd: int) -> Path:
    """The file of round `rnd`'s tensors in a client's state dir."""
    return Path(folder) / f"personal_round{rnd}.pt"


def read_round_file(path: Path, pid: int, rnd: int, keys, run: str | None = None) -> dict[str, torch.Tensor]:
    """Client `pid`'s tensors of round `rnd` from `path` (written by `PersonalStore.save`).

    Raises:
        PersonalStateError: the file cannot be read, is not that client's round (of run `run`, when
            given), or does not hold exactly `keys`.
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        refused = refused_unpickling(path, e)
        raise PersonalStateError(refused or f"cannot read {path} ({type(e).__name__}); round {rnd}") from None
    mine = {"format": FORMAT, "partition-id": pid, "round": rnd, **({} if run is None else {"run": run})}
    if not isinstance(saved, dict) or any(saved.get(k) != v for k, v in mine.items()):
        of_run = "" if run is None else " of this run: give each SuperNode its own state-dir"
        raise PersonalStateError(f"{path} is not client {pid}'s round {rnd}{of_run}")
    tensors = saved.get("tensors")
    if not isinstance(tensors, dict) or set(tensors) != set(keys):
        held = sorted(tensors) if isinstance(tensors, dict) else tensors
        raise PersonalStateError(f"{path} holds {held}, expected {sorted(keys)}")
    return dict(tensors)


class PersonalStore:
    """One client's personal tensors: `Context.state` and one file per round (module docstring).

    Args:
        state: the node's `context.state` (a Flower RecordDict), updated in place.
        folder: the state dir (`state_dir`).
        pid: the client's partition id (recorded in its files and checked on load).
        run: `run_digest` of the run config (a file of another run in the same folder is refused).
    """

    def __init__(self, state, folder: Path, pid: int, run: str):
        self.state, self.folder, self.pid, self.run = state, Path(folder), pid, run

    def path(self, rnd: int) -> Path:
        return round_file(self.folder, rnd)

    def load(self, rnd: int, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The personal tensors of round `rnd` (after this client trained in it); 0: `initial`."""
        if rnd == 0:
            return {k: v.clone() for k, v in initial.items()}
        meta = self.state.get(META)
        if meta is not None and int(meta["round"]) == rnd and str(meta["run"]) == self.run:
            return dict(self.state[ARRAYS].to_torch_state_dict())
        path = self.path(rnd)
        if not path.is_file():
            raise PersonalStateError(
                f"no personal tensors of round {rnd} at {path} (the server's checkpoint names that round; "
                "was the node-config state-dir changed or the folder deleted?)"
            )
        return read_round_file(path, self.pid, rnd, initial, self.run)

    def save(self, rnd: int, tensors: dict[str, torch.Tensor]) -> None:
        """Round `rnd`'s tensors: the file first (atomic), then `Context.state`."""
        from flwr.app import ArrayRecord, ConfigRecord

        tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        payload = {
            "format": FORMAT,
            "partition-id": self.pid,
            "run": self.run,
            "round": rnd,
            "tensors": tensors,
        }
        path = self.path(rnd)
        try:
            atomic_write(path, lambda tmp: torch.save(payload, tmp))
        except OSError as e:
            raise PersonalStateError(
                f"cannot write {path} ({e.strerror or type(e).__name__}); give the SuperNode a writable "
                "node-config state-dir=<folder>"
            ) from None
        self.state[ARRAYS] = ArrayRecord(tensors)
        self.state[META] = ConfigRecord({"round": rnd, "run": self.run})

    def prune(self, loaded: int) -> None:
        """Delete this client's files of rounds before `loaded` (never `loaded` itself or newer)."""
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            m = FILE.fullmatch(path.name)
            if m and int(m.group(1)) < loaded:
                path.unlink(missing_ok=True)
