"""tools/_cli.run_cli: bad input is one line, bugs keep their traceback, out of memory says what to try."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, run_tool_in_process

sys.path.insert(0, str(REPO / "tools"))
import _cli  # noqa: E402

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data import DataError  # noqa: E402
from coop.model.errors import ModelError  # noqa: E402
from coop.model.prompt import PromptError  # noqa: E402
from coop.model.weights import WeightsUnavailableError  # noqa: E402
from coop.train.engine import NonFiniteLossError  # noqa: E402
from coop.train.runner import RunError  # noqa: E402


def exit_of(error: BaseException, capsys) -> tuple[int, list[str]]:
    def main():
        raise error

    with pytest.raises(SystemExit) as info:
        _cli.run_cli(main)
    return info.value.code, capsys.readouterr().err.splitlines()


def test_config_error_is_one_line_exit_2(capsys):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["prompt.colour=red"])
    code, lines = exit_of(info.value, capsys)
    assert code == 2 and lines == ["error: unknown or invalid config key 'prompt.colour' in command line"]


@pytest.mark.parametrize(
    "error",
    [
        DataError("dataset root not found: /data"),
        RunError("out/run holds a run with a different config"),
        ModelError("unknown open_clip model 'ViT-Q-99'"),
        WeightsUnavailableError("open_clip weights 'openai' for ViT-B-16 are not in the local cache"),
        PromptError("prompt depth must be in 1..12"),
        FileNotFoundError("weights file not found: /x/ViT-B-16.pt"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_bad_input_errors_are_one_line_exit_2(error, capsys):
    assert exit_of(error, capsys) == (2, [f"error: {error}"])


@pytest.mark.parametrize(
    "module, name",
    [
        ("coop.train.checkpoint", "CheckpointError"),
        ("coop.methods", "TransferError"),
        ("coop.tta.base", "TestTimeError"),
    ],
)
def test_errors_of_other_modules_are_bad_input_when_they_exist(module, name, capsys, monkeypatch):
    """run_cli looks these classes up by name, so it works before and after they are added."""
    mod = pytest.importorskip(module)
    error_class = getattr(mod, name, None)
    if error_class is not None:
        assert exit_of(error_class("cannot use x.pt"), capsys) == (2, ["error: cannot use x.pt"])
    monkeypatch.delattr(mod, name, raising=False)  # as before the class existed
    assert exit_of(ConfigError("bad key"), capsys) == (2, ["error: bad key"])


def test_non_finite_loss_is_one_line_exit_1(capsys):
    assert exit_of(NonFiniteLossError("non-finite loss (nan)"), capsys) == (
        1,
        ["error: non-finite loss (nan)"],
    )


def test_a_federated_clients_non_finite_loss_is_one_line_exit_1(tiny_clip, capsys):
    """The federated client raises the run's NonFiniteLossError, so the tools report it the same way."""
    import torch
    from omegaconf import OmegaConf

    from coop.federated.client import local_train
    from coop.methods import CoOp

    cfg = OmegaConf.create(
        {"prompt": {"n_ctx": 2, "ctx_init": None, "position": "end", "csc": False, "depth": 1}}
    )
    method = CoOp(tiny_clip, ["red thing", "blue thing"], cfg)
    feats, labels = torch.full((1, 4, tiny_clip.embed_dim), float("nan")), torch.tensor([0, 1, 0, 1])
    kw = {"epochs": 1, "batch_size": 4, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "seed": 0}
    with pytest.raises(NonFiniteLossError) as info:
        local_train(method, feats, labels, **kw)
    assert exit_of(info.value, capsys) == (1, ["error: non-finite loss (nan) in epoch 1, step 1"])


@pytest.mark.parametrize(
    "error", [RuntimeError("bug"), ValueError("bug"), AssertionError("bug"), KeyError("bug")]
)
def test_other_errors_are_reraised(error, capsys):
    def main():
        raise error

    with pytest.raises(type(error)):
        _cli.run_cli(main)
    assert capsys.readouterr().err == ""


def run_script(body: str) -> subprocess.CompletedProcess:
    """Run `body` after `from _cli import run_cli` in a fresh interpreter (no torch import: fast)."""
    script = "import sys\nsys.path.insert(0, 'tools')\nfrom _cli import run_cli\n" + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_shape_mismatch_keeps_its_traceback():
    res = run_script(
        """
        def main():
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)")
        run_cli(main)
        """
    )
    assert res.returncode == 1
    assert res.stderr.startswith("Traceback (most recent call last)") and ", in main" in res.stderr
    assert res.stderr.rstrip().endswith(
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)"
    )
    assert "error:" not in res.stderr


def test_out_of_memory_prints_what_to_try_above_the_traceback():
    res = run_script(
        """
        def main():
            raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)")
        run_cli(main)
        """
    )
    assert res.returncode == 1
    err = res.stderr
    assert err.startswith("error: out of memory")
    hint = err[: err.index("Traceback (most recent call last)")]
    for fix in ("train.grad_checkpointing=true", "train.batch_size=", "train.eval_batch_size="):
        assert fix in hint
    assert err.rstrip().endswith("out of memory (MPS allocated: 17.00 GB)")


@pytest.mark.parametrize("oom", ["OutOfMemoryError", "cuda.OutOfMemoryError"])
def test_cuda_out_of_memory_error_gets_the_hint(oom, capsys):
    import torch

    cls = torch.cuda.OutOfMemoryError if oom.startswith("cuda") else getattr(torch, "OutOfMemoryError", None)
    if cls is None:
        pytest.skip("torch.OutOfMemoryError needs torch >= 2.5")
    error = cls("CUDA out of memory. Tried to allocate 20.00 GiB")

    def main():
        raise error

    with pytest.raises(cls):
        _cli.run_cli(main)
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory") and "train.grad_checkpointing=true" in err
    assert not _cli.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.pretrained=/no/such/ViT-B-16.pt", "error: weights file not found: /no/such/ViT-B-16.pt"),
        ("prompt.depth=9", "error: prompt.depth must be in 1..3 (the text tower's layers), got 9"),
    ],
)
def test_train_tool_bad_model_or_prompt_is_one_line(image_folder, tmp_path, monkeypatch, override, message):
    # in-process (the message is printed; train.py's real process is tested in test_train.py)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [
        f"model.name={REPO / 'configs' / 'models' / 'coop-tiny.json'}",
        "model.pretrained=none",
        "data.name=imagefolder",
        f"data.root={image_folder}",
        "data.num_workers=0",
        "device=cpu",
        f"output_dir={tmp_path / 'run'}",
        override,
    ]
    res = run_tool_in_process(REPO / "tools" / "train.py", args)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message) and "Traceback" not in res.stderr


# ----------------------------------------------------------------------- OpenMP's settings, before torch

NOTE_TORCH = """
import json, os, runpy, sys
seen = {}  # the OpenMP environment at the moment torch is first imported (OpenMP reads it then)

class TorchNext(BaseException):  # the tool stops at its first import of torch: the rest does not count
    pass

class NoteTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.update({k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")})
            raise TorchNext

sys.meta_path.insert(0, NoteTorch())
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except TorchNext:
    pass
import torch
print(json.dumps({**seen, "threads": torch.get_num_threads()}))
"""


def omp_at_torch_import(tool: str, **env: str) -> dict:
    """Run `tools/<tool> --help` in a fresh process up to its first import of torch: the OpenMP
    variables then, and torch's thread count once it is imported (the tool's other imports, open_clip
    and coop's, are skipped: 3 s of CPU instead of 9)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "COOP_OMP"))}
    res = subprocess.run(
        [sys.executable, "-c", NOTE_TORCH, str(REPO / "tools" / tool)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **env},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_tool_sets_openmps_wait_policy_before_torch_and_keeps_the_users():
    seen = omp_at_torch_import("train.py")
    assert seen["OMP_WAIT_POLICY"] == "PASSIVE" and seen["OMP_NUM_THREADS"] is None
    assert seen["threads"] == torch_default_threads()
    seen = omp_at_torch_import("train.py", OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1")
    assert seen == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1", "threads": 1}


def torch_default_threads() -> int:
    """torch's own intra-op thread count, in a process without OpenMP variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base).stdout)


def test_openmp_defaults_fill_only_what_the_user_left_unset():
    assert _cli.openmp_defaults(env := {}) == {"OMP_WAIT_POLICY": "PASSIVE"} and env == _cli.OPENMP_DEFAULTS
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert _cli.openmp_defaults(env) == {} and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"COOP_OMP_DEFAULTS": "0"}  # OpenMP's own defaults
    assert _cli.openmp_defaults(env) == {} and env == {"COOP_OMP_DEFAULTS": "0"}


def test_every_tool_imports_cli_before_anything_that_may_load_torch():
    """A tool's first import beyond the standard library is `_cli` (which sets OpenMP's settings)."""
    for path in sorted([*(REPO / "tools").glob("[!_]*.py"), *(REPO / "tools" / "bench").glob("[!_]*.py")]):
        tree = ast.parse(path.read_text())
        first = None
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                outside = [n for n in names if n and n.split(".")[0] not in sys.stdlib_module_names]
                if outside:
                    first = outside[0]
                    break
        assert first == "_cli", f"tools/{path.name} imports {first} before _cli"
