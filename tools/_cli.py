"""Shared command-line plumbing for the tools: OpenMP's settings, logging setup, and one-line errors
for bad input. Every tool imports this module first, before torch."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# torchrun's ranks but rank 0 draw no progress bars: tqdm reads TQDM_DISABLE when it is imported,
# and every tool imports this module first.
OTHER_RANK = int(os.environ.get("RANK", "0")) > 0
if OTHER_RANK:
    os.environ.setdefault("TQDM_DISABLE", "1")

# OpenMP's idle threads sleep instead of spinning: beside another busy process, torch's threads
# spinning at every parallel region's end took turns with it, and the demo's training epoch ran
# 2.9x slower (docs/performance.md, tools/bench/bench_threads.py). OpenMP reads its environment once,
# when torch loads it: hence here, before any tool imports torch. What the user set wins
# (OMP_WAIT_POLICY, OMP_NUM_THREADS); COOP_OMP_DEFAULTS=0 leaves OpenMP's own defaults.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def openmp_defaults(environ=os.environ) -> dict[str, str]:
    """Set OPENMP_DEFAULTS in `environ` where it holds no value of its own; returns what was set."""
    if environ.get("COOP_OMP_DEFAULTS", "1") == "0":
        return {}
    added = {k: v for k, v in OPENMP_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


if "torch" not in sys.modules:  # later, OpenMP has read its environment: nothing to change
    openmp_defaults()


def setup_logging(verbose: bool = False) -> None:
    """coop's own loggers at INFO (DEBUG with -v); others (open_clip logs on the root) at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("coop").setLevel(logging.DEBUG if verbose else logging.INFO)
    if OTHER_RANK:  # torchrun's ranks but rank 0 log warnings only
        logging.getLogger("coop").setLevel(logging.WARNING)
    for noisy in ("PIL", "matplotlib", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


TOKENIZER_HELP = (
    "the saved Hugging Face tokenizer's directory on this machine, in place of the run's "
    "model.tokenizer (an absolute path where the run was made); for runs and exports moved here"
)


def add_model_args(ap) -> None:
    """--pretrained/--tokenizer/--device/-v for tools that rebuild a run's model from its checkpoint."""
    ap.add_argument(
        "--pretrained", default="config", help="weights override (tag or file) for the run's model"
    )
    ap.add_argument("--tokenizer", metavar="DIR", help=TOKENIZER_HELP)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-v", "--verbose", action="store_true")


@contextmanager
def tokenizer_hint(given: str | None) -> Iterator[None]:
    """Around rebuilding a saved run's model: a TokenizerError (the run's `model.tokenizer` is not on
    this machine, or the hub's tokenizer is neither cached nor reachable) also names --tokenizer,
    unless it was given."""
    from coop.model.tokenizer import TokenizerError

    try:
        yield
    except TokenizerError as e:
        if given is not None:
            raise
        raise TokenizerError(
            f"{one_line(e)}; for a run or export made elsewhere, give the tokenizer's directory on this "
            "machine with --tokenizer DIR"
        ) from None


def one_line(error: BaseException) -> str:
    """The message of `error`; for one re-raised from a DataLoader worker, the original one."""
    text = str(error).strip()
    if "Original Traceback" in text:  # "Caught DataError in DataLoader worker ... <traceback>"
        last = text.splitlines()[-1]
        head, sep, rest = last.partition(": ")
        text = rest if sep and " " not in head else last
    return text


# Errors that mean bad input (config, data, run folder, output place, checkpoint, learned tensors applied
# to other classes, model or weights, prompt settings): one line and exit 2. Looked up by module and name in
# sys.modules, so nothing is imported here (a class never imported cannot have been raised) and a
# class that does not exist yet is skipped.
BAD_INPUT = (
    ("coop.config.load", "ConfigError"),
    ("coop.data", "DataError"),
    ("coop.train.runner", "RunError"),
    ("coop.train.lock", "RunLockedError"),
    ("coop.train.lock", "NotARunFolderError"),
    ("coop.io", "OutputError"),
    ("coop.train.checkpoint", "CheckpointError"),
    ("coop.methods", "TransferError"),
    ("coop.model.errors", "ModelError"),
    ("coop.model.weights", "WeightsUnavailableError"),
    ("coop.model.tokenizer", "TokenizerError"),
    ("coop.model.prompt", "PromptError"),
    ("coop.interop", "InteropError"),
    ("coop.tta.base", "TestTimeError"),
)
# A run that failed for a reason the message explains: one line and exit 1.
RUN_FAILED = (("coop.train.engine", "NonFiniteLossError"),)

OOM_HINT = """\
error: out of memory. To fit, try one or more of:
  train.grad_checkpointing=true   recompute text activations in the backward pass (many classes)
  train.batch_size=16             a smaller training batch (changes the recipe: use a new output_dir)
  train.eval_batch_size=50        a smaller evaluation batch (does not change results)
The traceback follows."""


def _classes(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException))


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that `run_cli` prints as one line (among those imported so far)."""
    return (FileNotFoundError, PermissionError, *_classes(BAD_INPUT))


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or another backend's "out of memory" RuntimeError (e.g. MPS)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(
        getattr(torch, "cuda", None), "OutOfMemoryError", None
    )
    if isinstance(oom, type) and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _say(message: str) -> None:
    """Print an error line on rank 0 only: under torchrun every rank meets the same bad input."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr)


def run_cli(main: Callable[[], int | None]) -> None:
    """Run `main` and exit with its code, turning known errors into short messages.

    - bad input (`bad_input_errors()`: config, data, run folder, checkpoint, model, weights, a missing
      file): one `error: ...` line, exit 2;
    - a run that failed with an explained reason (non-finite loss): one `error: ...` line, exit 1;
    - out of memory: what to try, then the traceback (exit 1);
    - anything else is a bug and keeps its full traceback (exit 1); Ctrl-C exits 130.

    Under torchrun the one-line messages come from rank 0 alone (the other ranks exit with the same
    code, silently); a bug's traceback is printed by every rank that meets it.
    """
    try:
        code = main()
        distributed = sys.modules.get("coop.distributed")
        if distributed is not None:  # leave a torchrun run's process group cleanly
            distributed.close()
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if isinstance(e, bad_input_errors()):
            _say(f"error: {one_line(e)}")
            sys.exit(2)
        if isinstance(e, _classes(RUN_FAILED)):
            _say(f"error: {one_line(e)}")
            sys.exit(1)
        if is_out_of_memory(e):
            print(OOM_HINT, file=sys.stderr)
        raise
    sys.exit(code or 0)
