"""A trained prompt as a classifier: `coop.load_classifier(path)` on a run folder or an exported file.

    clf = coop.load_classifier("prompts.safetensors", device="cuda")
    probs = clf.predict(torch.stack([clf.transform(img) for img in images]))   # (B, n_cls)
    clf.classnames[probs.argmax(-1)[0]]
    other = coop.load_classifier("prompts.safetensors", classnames=["cat", "dog"])

The classifier is the run's method (`coop.methods`) rebuilt from its config, with the learned
tensors loaded and CLIP's weights from `model.pretrained`: its logits are those of `tools/eval.py`
(the same method, precision and test transform). Other class names work where the method
transfers (shared context, vision prompts, CoCoOp's meta-net), as `eval.targets` does; class-specific
context and the linear probe's rows refuse with a TransferError. A federated run gives its global
model, or with `client=k` client k's personalised one (`coop.interop.federated`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from coop.config.load import load_config
from coop.data import DataError
from coop.data.folders import IMAGE_EXTENSIONS
from coop.data.images import load_image
from coop.interop.export import ExportError, read_export, run_checkpoint
from coop.interop.federated import build_federated, federated_method, run_model
from coop.methods import Method, build_method
from coop.model.weights import load_clip
from coop.train.checkpoint import load_checkpoint
from coop.train.engine import clip_transforms, resolve_device, use_fp16
from coop.train.precision import autocast, resolve_precision
from coop.train.preflight import check_run_model

log = logging.getLogger(__name__)


class Classifier:
    """A method with its learned tensors, ready to score preprocessed images.

    Args:
        method: the built method (learned tensors loaded).
        transform: the test transform (PIL image -> (3, H, W) tensor).
        device: where the model runs.
        precision: what runs there (`coop.train.precision.resolve_precision`).
    """

    def __init__(self, method: Method, transform, device: torch.device, precision: str):
        self.method, self.transform = method.eval(), transform
        self.device, self.precision = device, precision
        self._prepared = None  # text features (and vision prompts): once, not per batch

    @property
    def classnames(self) -> list[str]:
        return self.method.classnames

    @torch.no_grad()
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """fp32 logits (B, n_cls) of preprocessed images (B, 3, H, W)."""
        method, clip = self.method, self.method.clip
        x = images.to(self.device, clip.logit_scale.dtype)
        with autocast(self.device, self.precision):
            if self._prepared is None:
                self._prepared = method.prepare()
            if method.input == "features":  # the frozen tower: (B, E), or every token (B, n_prefix+P, E)
                x = clip.encode_image(x, tokens=method.image_tokens)
            return method.logits(x, self._prepared).float()

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities (B, n_cls): the softmax of `logits`."""
        return self.logits(images).softmax(dim=-1)


def read_prompts(
    path: str | os.PathLike, client: int | None = None
) -> tuple[dict[str, torch.Tensor], dict, list[str], str | None, str | None, dict | None]:
    """(learned tensors, run config, trained class names, federated method, model, tokenizer) of a run
    folder, checkpoint.pt or exported `.safetensors` file; federated method and model are None except
    for a federated run (`coop.interop.federated`: its global model, or with `client` that client's
    own); tokenizer is the identity of the run's tokenizer (`PromptTokenizer.identity`), None for a
    run made before coop recorded it."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        if client is not None:
            raise ExportError(f"{path} holds one model ({read_export(path)[1]['model'] or 'not federated'}): "
                              "a client is chosen when exporting (tools/export.py --client)")  # fmt: skip
        tensors, card = read_export(path)
        return (
            tensors,
            card["config"],
            card["classnames"],
            card["federated"],
            card["model"],
            card["tokenizer"],
        )
    ckpt_path = run_checkpoint(path)
    ckpt = load_checkpoint(ckpt_path)
    tensors, model = run_model(ckpt_path.parent, ckpt, client)
    return (
        tensors,
        ckpt["config"],
        list(ckpt["classnames"]),
        federated_method(ckpt),
        model,
        ckpt.get("tokenizer"),
    )


def load_classifier(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    classnames: list[str] | None = None,
    pretrained: str | None = "config",
    client: int | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> Classifier:
    """The classifier of a run folder, its `checkpoint.pt`, or a file from `tools/export.py`.

    Args:
        path: the run or the exported file.
        device: where to run ("cpu", "cuda", "auto").
        classnames: score these classes instead of the trained ones (where the method transfers).
        pretrained: "config" for the run's `model.pretrained`, or another tag / weights file.
        client: a federated FedOTP or FedPGP run's client whose own model to use (default: the
            global model); for run folders only (an export holds one model).
        tokenizer: a saved Hugging Face tokenizer's directory in place of the run's
            `model.tokenizer` (a run or export made on another machine records that machine's
            directory); None: the run's.

    Raises:
        CheckpointError, ExportError: the file cannot be read, or has no model for `client`.
        TransferError: the learned tensors cannot score `classnames`.
        TokenizerError: the tokenizer cannot be loaded (`coop.model.tokenizer.load_tokenizer`), does
            not fit the model, or is not the one the run was trained with
            (`coop.train.preflight.check_run_model`; a warning for a run that recorded none).
        ModelError, WeightsUnavailableError: the model cannot be rebuilt here.
    """
    tensors, config, trained, fl_method, model, recorded = read_prompts(path, client)
    cfg = load_config(None, [], base=config)
    device = resolve_device(str(device))
    if pretrained != "config":
        cfg.model.pretrained = pretrained
    if tokenizer is not None:  # an empty one is refused, not taken for the run's
        cfg.model.tokenizer = str(tokenizer)
    check_run_model(cfg, recorded, str(path))  # before the weights are read
    clip = load_clip(cfg.model.name, cfg.model.pretrained, device, cfg.model.tokenizer)
    names = list(trained if classnames is None else classnames)
    torch.manual_seed(int(cfg.data.seed))  # any tensor the method does not load starts as in training
    if fl_method is None:
        method = build_method(clip.float(), names, cfg)
    else:
        method, tensors = build_federated(clip.float(), names, cfg, fl_method, model, tensors)
    method.load_trained(tensors, trained)  # as evaluation does: it knows the training classes
    precision = resolve_precision(cfg.train.precision, device)
    if precision == "fp16":
        use_fp16(clip, method)
    log.info(
        "%s (%s, %s) on %d classes from %s",
        cfg.method if fl_method is None else f"fl.method={fl_method} ({model} model)",
        cfg.model.name,
        cfg.model.pretrained,
        len(names),
        path,
    )
    return Classifier(method.to(device), clip_transforms(clip)[1], device, precision)


def list_image_files(folder: str | os.PathLike) -> list[Path]:
    """Every image file under `folder` (recursively, by extension), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder not found: {folder}")
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def predict_files(
    clf: Classifier, files: list[Path], topk: int = 5, batch_size: int = 64, progress: bool = True
) -> Iterator[tuple[Path, list[tuple[str, float]] | None]]:
    """(file, [(class, probability)] * topk) per image, best first; None for an unreadable image.

    Args:
        clf: the classifier.
        files: the images.
        topk: classes per image (at most the number of classes).
        batch_size: images per forward pass.
        progress: show a progress bar.
    """
    k = min(int(topk), len(clf.classnames))
    bar = tqdm(total=len(files), desc="images", unit="img", disable=not progress, dynamic_ncols=True)
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        top: list[list[tuple[str, float]] | None] = [None] * len(chunk)
        images, ok = [], []
        for j, f in enumerate(chunk):
            try:
                images.append(clf.transform(load_image(str(f))))
                ok.append(j)
            except DataError as e:  # an unreadable image is reported, not fatal
                log.warning("skipping %s: %s", f, e)
        if images:
            probs, idx = clf.predict(torch.stack(images)).topk(k, dim=-1)  # (b, k)
            for j, p, i in zip(ok, probs.tolist(), idx.tolist(), strict=True):
                top[j] = [(clf.classnames[c], q) for c, q in zip(i, p, strict=True)]
        yield from zip(chunk, top, strict=True)
        bar.update(len(chunk))
    bar.close()


__all__ = ["Classifier", "list_image_files", "load_classifier", "predict_files", "read_prompts"]
