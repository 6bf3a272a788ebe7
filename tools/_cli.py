"""Shared command-line plumbing for the tools: logging setup and one-line errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable


def setup_logging(verbose: bool = False) -> None:
    """coop's own loggers at INFO (DEBUG with -v); others (open_clip logs on the root) at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("coop").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("PIL", "matplotlib", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_model_args(ap) -> None:
    """--pretrained/--device/-v for tools that rebuild a run's model from its checkpoint."""
    ap.add_argument(
        "--pretrained", default="config", help="weights override (tag or file) for the run's model"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-v", "--verbose", action="store_true")


def one_line(error: BaseException) -> str:
    """The message of `error`; for one re-raised from a DataLoader worker, the original one."""
    text = str(error).strip()
    if "Original Traceback" in text:  # "Caught DataError in DataLoader worker ... <traceback>"
        last = text.splitlines()[-1]
        head, sep, rest = last.partition(": ")
        text = rest if sep and " " not in head else last
    return text


def run_cli(main: Callable[[], int | None]) -> None:
    """Run `main`; bad input becomes one `error: ...` line (exit 2), a failed run exit 1."""
    from coop.engine import NonFiniteLossError

    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)
