"""A test-time pass's per-image outputs on disk: atomic chunks while it runs, one file when done.

    outputs.<start>-<end>.safetensors    the images at stream positions [start, end): logits, labels, index
    tta_state.pt                         an online method's state() after the last chunk, with its position
    outputs.safetensors                  every image in stream order (the chunks, joined; then deleted)

The stream is the order in which the pass visits the test split: the split's own order for an
episodic method, a permutation seeded by the run's seed for an online one (`stream_order`). Rank 0
writes every chunk (atomically: a killed write leaves no partial file), one after the other, so the
chunks on disk always cover a prefix [0, p) of the stream: a rerun continues at p. An online
method's state is written after its chunk; a chunk beyond the state's position (killed between the
two writes) is dropped and computed again from the state, so that both agree.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from coop.io import atomic_write

OUTPUTS = "outputs.safetensors"
STATE = "tta_state.pt"
CHUNK = re.compile(r"outputs\.(\d{8})-(\d{8})\.safetensors")
FIELDS = ("logits", "labels", "index")


def stream_order(n: int, online: bool, seed: int) -> torch.Tensor:
    """The positions in the split of the stream's images (N,): the split's order for an episodic
    pass, a permutation seeded by `seed` for an online one."""
    if not online:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))


def chunk_path(folder: Path, start: int, end: int) -> Path:
    return folder / f"outputs.{start:08d}-{end:08d}.safetensors"


def chunks(folder: Path) -> list[tuple[int, int, Path]]:
    """(start, end, path) of the chunks in `folder`, in stream order."""
    found = (CHUNK.fullmatch(p.name) for p in folder.iterdir())
    return sorted((int(m[1]), int(m[2]), folder / m[0]) for m in found if m)


def covered(folder: Path) -> int:
    """The end p of the prefix [0, p) of the stream that the chunks cover; a chunk after a gap is
    deleted (it cannot be, as rank 0 writes them in order, but a rerun must never trust one)."""
    p = 0
    for start, end, path in chunks(folder):
        if start != p:
            path.unlink()
            continue
        p = end
    return p


def drop_after(folder: Path, position: int) -> None:
    """Delete the chunks that end after `position` (written after the last saved state)."""
    for _, end, path in chunks(folder):
        if end > position:
            path.unlink()


def write_chunk(folder: Path, start: int, end: int, rows: list[tuple[torch.Tensor, int, int]], n_cls: int):
    """The chunk of stream positions [start, end) from its readable images' (logits, label, index)."""
    tensors = pack(rows, n_cls)
    atomic_write(chunk_path(folder, start, end), lambda tmp: save_file(tensors, tmp))


def pack(rows: list[tuple[torch.Tensor, int, int]], n_cls: int) -> dict[str, torch.Tensor]:
    logits = torch.stack([r[0] for r in rows]) if rows else torch.zeros(0, n_cls)
    return {
        "logits": logits.float().contiguous(),
        "labels": torch.tensor([r[1] for r in rows], dtype=torch.int64),
        "index": torch.tensor([r[2] for r in rows], dtype=torch.int64),
    }


def join_chunks(folder: Path) -> dict[str, torch.Tensor]:
    """Every chunk's rows in stream order, as `outputs.safetensors` holds them."""
    parts = [load_file(path) for _, _, path in chunks(folder)]
    return {k: torch.cat([p[k] for p in parts]) for k in FIELDS}


def write_outputs(folder: Path, outputs: dict[str, torch.Tensor]) -> None:
    """`outputs.safetensors`, then the chunks it replaces are deleted."""
    atomic_write(folder / OUTPUTS, lambda tmp: save_file(outputs, tmp))
    for _, _, path in chunks(folder):
        path.unlink()
    (folder / STATE).unlink(missing_ok=True)


def read_outputs(folder: str | Path) -> dict[str, torch.Tensor]:
    """A finished pass's `outputs.safetensors`: logits (N, n_cls), labels (N,), index (N,)."""
    return load_file(Path(folder) / OUTPUTS)


def save_state(folder: Path, position: int, state: dict[str, torch.Tensor]) -> None:
    """An online method's `state()` after stream position `position`, atomically."""
    state = {k: v.detach().cpu().clone() for k, v in state.items()}
    atomic_write(folder / STATE, lambda tmp: torch.save({"position": position, "state": state}, tmp))


def load_state(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(position, state) of the last saved state; (0, {}) if none was saved."""
    path = folder / STATE
    if not path.is_file():
        return 0, {}
    saved = torch.load(path, weights_only=True)
    return int(saved["position"]), saved["state"]
