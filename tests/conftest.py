"""Shared fixtures: random-weight OpenCLIP models with every text-tower term randomised."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import open_clip
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "models" / "coop-tiny.json"

logging.getLogger().setLevel(logging.ERROR)  # open_clip warns about random init on every build


def randomise_text_tower(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give LayerNorm weights and all biases non-trivial values so that no term hides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("visual."):
                continue
            if "ln" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def randomise_prompts(learner: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every prompt tensor with N(0, 1) values so that layouts and deep tokens all matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return learner


def build_openclip(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """open_clip's model `name` with random weights (`overrides`: config entries that replace its own);
    a Hugging Face text tower from its transformers config as `coop.load_clip` builds it (inline in
    the tiny configs)."""
    from coop.model.weights import hf_text_building

    torch.manual_seed(seed)
    with hf_text_building(name, overrides):
        model = open_clip.create_model(name, pretrained=None, **overrides)
    return randomise_text_tower(model, seed).eval()


def build_family(stem: str | Path, tokenizer: Path | None = None, seed: int = 0, edit=None):
    """(our CLIP, open_clip's model) of the tiny family model configs/models/{stem}.json (or of the
    model config file `stem`, a Path): random
    weights, the text tower's LayerNorms and biases randomised, the tokenizer read from directory
    `tokenizer` (coop/model/tiny_tokenizers.py; None: CLIP's BPE); `edit(model)` runs on open_clip's
    model before ours copies its weights. Ours is built from a copy of it: `CLIP.from_openclip`
    takes a timm image tower over, and what a method does to ours (CLIP-LoRA's hooks) must not
    reach the reference."""
    import coop
    from coop.model.tokenizer import load_tokenizer
    from coop.model.weights import resolve_model_name

    path = stem if isinstance(stem, Path) else REPO / "configs" / "models" / f"{stem}.json"
    name = resolve_model_name(str(path))
    oc = build_openclip(name, seed)
    if edit is not None:
        edit(oc)
    ours = coop.CLIP.from_openclip(copy.deepcopy(oc), tokenizer=load_tokenizer(name, tokenizer), name=name)
    return ours, oc


@contextmanager
def shrunk_timm(**kwargs):
    """Inside the block, every timm trunk is built with `kwargs` added (e.g. depth=2, img_size=64,
    embed_dim=64): open_clip's config names no depth or size for a timm tower, so this is how a test
    builds one small (open_clip calls `timm.create_model` through the `timm` module)."""
    import functools

    import timm

    original = timm.create_model
    timm.create_model = functools.partial(original, **kwargs)
    try:
        yield
    finally:
        timm.create_model = original


def small_timm_config(config: Path, folder: Path, size: int) -> Path:
    """A copy of the timm-tower model config `config` at `size`-pixel images, in `folder` under a
    name of its own (`<stem>-<size>`: open_clip's registry keeps the real one). Build it inside
    `shrunk_timm(img_size=size, ...)`: open_clip passes timm no image size."""
    cfg = json.loads(Path(config).read_text())
    cfg["vision_cfg"]["image_size"] = size
    path = Path(folder) / f"{Path(config).stem}-{size}.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="session")
def tiny_name() -> str:
    open_clip.add_model_config(TINY_CONFIG)
    return TINY_CONFIG.stem


@pytest.fixture(scope="session")
def tiny_openclip(tiny_name):
    return build_openclip(tiny_name)


@pytest.fixture(scope="session")
def tiny_clip(tiny_openclip):
    import coop

    return coop.CLIP.from_openclip(tiny_openclip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Few-shot and feature caches go to a per-session temp folder, never to ~/.cache."""
    monkeypatch.setenv("COOP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "coop-cache"))


def make_image_folder(root: Path, classes=("red_thing", "green_thing", "blue_thing"), n_train=6, n_test=4):
    """A tiny ImageFolder dataset whose classes differ by colour, so prompts can learn them."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    for split, n in (("train", n_train), ("test", n_test)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                noise = torch.randint(-30, 30, (32, 32, 3), generator=gen)
                pixels = (torch.tensor(colours[c % 4]) + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("imagefolder"))


def tiny_args(folder, out, **extra) -> list[str]:
    """`key=value` overrides of a tiny, fast CPU training run on an image folder (plus `extra`)."""
    args = {
        "model.name": str(TINY_CONFIG),
        "model.pretrained": "none",
        "data.name": "imagefolder",
        "data.root": str(folder),
        "data.shots": 4,
        "data.num_workers": 0,
        "train.epochs": 4,
        "train.batch_size": 4,
        "train.lr": 0.05,
        "device": "cpu",
        "output_dir": str(out),
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


# ---------------------------------------------------------------- parallel runs and tools in-process

# One intra-op thread in this process and in the tools it starts (subprocesses inherit the variable):
# with two xdist workers on two cores, two threads each only spin-wait for each other; the tiny
# models gain nothing from more. An OMP_NUM_THREADS set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Ray's memory monitor kills a worker (a simulation's client actor) when the MACHINE's memory use
# passes 95%, whoever uses it: on a machine shared with other jobs that fails clients of runs whose
# results the tests compare exactly. Off for the tests (and the tools they start); the kernel's OOM
# killer still acts when memory runs out. A value set by the caller wins.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")


@pytest.fixture(scope="module")
def fl_env(tmp_path_factory, request):
    """Federated runs' environment: one feature cache per test module, never ~/.cache (the autouse
    cache fixture is function-scoped, too late for the module-scoped reference run), and a marker
    that every process of the module's runs inherits (`COOP_TEST_RUN`; see `fl_processes`)."""
    marker = f"{os.getpid()}-{request.module.__name__}-{time.monotonic_ns()}"
    return {
        **os.environ,
        "COOP_CACHE_DIR": str(tmp_path_factory.mktemp("fl-cache")),
        "COOP_TEST_RUN": marker,
    }


_FL_SESSIONS: dict[str, dict[int, int]] = {}  # marker -> the sessions its runs' processes led (`scan`)


def fl_processes(env: dict) -> dict[int, str]:
    """{pid: command line} of the processes that still run from the federated runs started with
    `env`: those whose environment holds its marker, and those in the sessions that such processes
    led when this looked before (Ray's workers and agents may lose the marker from what /proc shows
    of their environment: `coop.federated.reaper.scan`)."""
    from coop.federated.reaper import scan

    marker = env["COOP_TEST_RUN"]
    pids, _FL_SESSIONS[marker] = scan(marker, var="COOP_TEST_RUN", sessions=_FL_SESSIONS.get(marker))
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return out


@contextmanager
def noting_fl_sessions(env: dict):
    """While the block runs, look at the runs started with `env` every 0.5 s (`fl_processes`), so
    that a later look knows the sessions they led."""
    import threading

    done = threading.Event()

    def note() -> None:
        while not done.wait(0.5):
            fl_processes(env)

    thread = threading.Thread(target=note, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# The longest files first: `make test` runs `--dist loadfile` (a file per worker), so a long file
# collected last would run alone at the end.


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test; the hub is offline for huggingface_hub too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to reach the network: {args[:2]}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


LONG_FILES = (  # started first, so that no long file is the last one a worker runs
    "test_federated_runs.py",
    "test_train.py",
    "test_protocols.py",
    "test_research.py",
    "test_bench.py",
    "test_tta.py",
    "test_models_table.py",
    "test_tta_online.py",
    "test_shipped_recipes.py",
    "test_tpt.py",
    "test_twosfs.py",
    "test_coprompt.py",
    "test_hicropl.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: order kept within a file


def fork_tool(cmd: list[str]) -> int:
    """Start `cmd` (`[python, tool, *args]` or `[python, "-c", code, *args]`) in a process forked
    from this one, in the repository, its output to /dev/null; its pid (reap it with os.waitpid). A
    real process without the seconds of importing torch again, for the tests that kill or stop a
    run; a fresh interpreter is tested where that is the point (tools' exit codes and consoles,
    locks between sweeps, torchrun)."""
    import sys

    pid = os.fork()
    if pid == 0:  # the child runs the tool's `__main__` and never returns to pytest
        try:
            # tqdm's write lock holds a semaphore shared across fork: a child killed while it draws a
            # bar would leave it taken, and this process's next bar would wait for it forever
            import threading

            import tqdm

            tqdm.tqdm.set_lock(threading.RLock())
            os.chdir(REPO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if cmd[1] == "-c":
                sys.argv = ["-c", *cmd[3:]]
                exec(compile(cmd[2], "<string>", "exec"), {"__name__": "__main__"})
            else:
                run_tool_in_process(Path(cmd[1]), cmd[2:])
        finally:
            os._exit(0)
    return pid


def kill_at_first_checkpoint(cmd: list[str], out: Path, timeout: float = 300) -> None:
    """Start `cmd` (`fork_tool`: a tool that trains into `out`) and SIGKILL it once
    out/checkpoint.pt exists: a crash at an arbitrary point after the first epoch, which a resume
    must make good."""
    import signal
    import time

    pid = fork_tool(cmd)
    deadline, ended = time.time() + timeout, False
    while not (out / "checkpoint.pt").exists() and time.time() < deadline:
        if ended := os.waitpid(pid, os.WNOHANG)[0] == pid:
            break
        time.sleep(0.005)
    if not ended:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@contextmanager
def interrupted_at(epoch: int):
    """Training runs started inside stop (like Ctrl-C) when they reach 0-based `epoch`, after the
    checkpoint of the epoch before: the state a resume starts from."""
    import coop.train.runner

    real = coop.train.runner.train_one_epoch

    def stop(s, optimizer, e, *args):
        if e == epoch:
            raise KeyboardInterrupt
        return real(s, optimizer, e, *args)

    coop.train.runner.train_one_epoch = stop
    try:
        yield
    finally:
        coop.train.runner.train_one_epoch = real


def run_tool_in_process(script: Path, args: list[str], log: bool = False):
    """Run `python <script> <args>` in this process: the script's own `__main__` path, its exit code,
    stdout and stderr, as `subprocess.run(..., capture_output=True, text=True)` returns them, without
    the 5-10 s of starting Python and importing torch. What the tool prints is in stderr; what it
    logs (the tools' logging is set up once per process, and pytest holds the root logger's
    handlers) only with `log=True`: coop's log lines, as a tool's console shows them. Keep a real
    subprocess test per tool.
    """
    import contextlib
    import io
    import runpy
    import subprocess
    import sys

    argv, path = [str(script), *map(str, args)], list(sys.path)
    levels = {name: logging.getLogger(name).level for name in ("", "coop")}
    out, err, code = io.StringIO(), io.StringIO(), 0
    console = logging.StreamHandler(err)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if log:
        logging.getLogger("coop").addHandler(console)
    old_argv, sys.argv = sys.argv, argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            err.write(f"{e.code}\n")  # sys.exit("message") prints it, as the interpreter would
    finally:
        sys.argv, sys.path[:] = old_argv, path
        logging.getLogger("coop").removeHandler(console)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
