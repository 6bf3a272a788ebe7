"""Published figures of the CoOp family, each with its source and whether it was checked.

    from coop.results.published import FIGURES, lookup
    lookup("cocoop", "base_to_new", "dtd", "accuracy")    # Figure(value=77.01, source=..., checked=False)

All figures are ViT-B/16 with OpenAI's CLIP weights, 16 shots, accuracy in %, as the papers
report them (mean of 3 seeds), except where `model` and `shots` say otherwise (Tip-Adapter's RN50
few-shot curves). `method` is our `method` name (`zeroshot` is zero-shot CLIP with
the hand-crafted prompt). Protocols and metrics:

| protocol | dataset | metric |
|---|---|---|
| `few_shot` | the dataset trained and tested on (`shots` per class) | `accuracy` |
| `base_to_new` | trained on its base half, tested on both | `accuracy` (base), `new_accuracy`, `hm` |
| `cross_dataset` | trained on ImageNet; `imagenet` is the source accuracy | `accuracy` |
| `domain_generalization` | trained on ImageNet, tested on -V2/-Sketch/-A/-R | `accuracy` |

`dataset="average"` is the paper's own mean (over the 11 datasets; over the 10 targets for
cross-dataset; over the 4 targets for domain generalisation).

`checked=True` means the number was compared with the paper or with a reprint of its table that
could be read where this file was written: the tables that the MaPLe, PromptSRC, KgCoOp, ProText
and PromptAlign repositories reprint in their READMEs (CLIP/CoOp/CoCoOp/MaPLe/PromptSRC/KgCoOp
base-to-new means, IVLP and VPT base-to-new means as MaPLe's model zoo lists them, CoPrompt's
base-to-new means as its README lists them, the
cross-dataset means, and CoOp/CoCoOp/MaPLe on the four ImageNet variants). The per-dataset
figures could not be checked against a table here and are `checked=False`; the tests hold them
to what was checked: their mean equals the checked average to within rounding, and their HM
equals the HM column. CoOp's few-shot figures are plotted, not tabulated, in its paper; only the
16-shot means are quoted (unchecked), and no linear-probe ViT-B/16 figure could be read here.

The recipes behind the figures: CoOp few-shot M = 16 random init; base-to-new, cross-dataset and
domain generalisation as CoCoOp ran them (CoOp and CoCoOp M = 4 from "a photo of a"); MaPLe,
PromptSRC, IVLP and VPT with their own papers' configs. Compare a run with the figure of the
same recipe (`configs/protocols/`).
"""

from __future__ import annotations

from typing import NamedTuple

DATASETS_11 = (
    "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
    "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101",
)  # fmt: skip
DG_TARGETS = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
PROTOCOLS = ("few_shot", "base_to_new", "cross_dataset", "domain_generalization")

COCOOP = "CoCoOp (Zhou et al., CVPR 2022)"
MAPLE = "MaPLe (Khattak et al., CVPR 2023)"
PROMPTSRC = "PromptSRC (Khattak et al., ICCV 2023)"
KGCOOP = "KgCoOp (Yao et al., CVPR 2023)"
COOP = "CoOp (Zhou et al., IJCV 2022)"
TIP = "Tip-Adapter (Zhang et al., ECCV 2022), Figures 4 and 5; read in its repository's exp.log"
CLIP_LORA = "CLIP-LoRA (Zanella & Ben Ayed, CVPRW 2024)"
MMRL = "MMRL (Guo & Gu, CVPR 2025)"
TCP = "TCP (Yao et al., CVPR 2024)"
DEPT = "DePT (Zhang et al., CVPR 2024)"
HICROPL = "HiCroPL (Zheng et al., ICCV 2025)"
COPROMPT = "CoPrompt (Roy & Etemad, ICLR 2024)"


class Figure(NamedTuple):
    method: str
    protocol: str
    dataset: str
    metric: str
    value: float
    source: str
    checked: bool
    shots: int = 16
    model: str = "ViT-B-16"  # `coop.config.run_names.model_tag` of the backbone


# Base-to-new, per dataset in DATASETS_11 order then "average": (base, new, HM).
# source, method -> (table, rows, which averages were checked and where)
BASE_TO_NEW = {
    "zeroshot": (COCOOP + ", Table 1", "MaPLe/PromptSRC/KgCoOp READMEs", [
        (72.43, 68.14, 70.22), (96.84, 94.00, 95.40), (91.17, 97.26, 94.12), (63.37, 74.89, 68.65),
        (72.08, 77.80, 74.83), (90.10, 91.22, 90.66), (27.19, 36.29, 31.09), (69.36, 75.35, 72.23),
        (53.24, 59.90, 56.37), (56.48, 64.05, 60.03), (70.53, 77.50, 73.85), (69.34, 74.22, 71.70)]),
    "coop": (COCOOP + ", Table 1", "MaPLe/PromptSRC READMEs", [
        (76.47, 67.88, 71.92), (98.00, 89.81, 93.73), (93.67, 95.29, 94.47), (78.12, 60.40, 68.13),
        (97.60, 59.67, 74.06), (88.33, 82.26, 85.19), (40.44, 22.30, 28.75), (80.60, 65.89, 72.51),
        (79.44, 41.18, 54.24), (92.19, 54.74, 68.69), (84.69, 56.05, 67.46), (82.69, 63.22, 71.66)]),
    "cocoop": (COCOOP + ", Table 1", "MaPLe/PromptSRC/KgCoOp READMEs", [
        (75.98, 70.43, 73.10), (97.96, 93.81, 95.84), (95.20, 97.69, 96.43), (70.49, 73.59, 72.01),
        (94.87, 71.75, 81.71), (90.70, 91.29, 90.99), (33.41, 23.71, 27.74), (79.74, 76.86, 78.27),
        (77.01, 56.00, 64.85), (87.49, 60.04, 71.21), (82.33, 73.45, 77.64), (80.47, 71.69, 75.83)]),
    "kgcoop": (KGCOOP + ", Table 1", "KgCoOp README", [
        (75.83, 69.96, 72.78), (97.72, 94.39, 96.03), (94.65, 97.76, 96.18), (71.76, 75.04, 73.36),
        (95.00, 74.73, 83.65), (90.50, 91.70, 91.09), (36.21, 33.55, 34.83), (80.29, 76.53, 78.36),
        (77.55, 54.99, 64.35), (85.64, 64.34, 73.48), (82.89, 76.67, 79.65), (80.73, 73.60, 77.00)]),
    "maple": (MAPLE + ", Table 1", "MaPLe/PromptSRC READMEs", [
        (76.66, 70.54, 73.47), (97.74, 94.36, 96.02), (95.43, 97.76, 96.58), (72.94, 74.00, 73.47),
        (95.92, 72.46, 82.56), (90.71, 92.05, 91.38), (37.44, 35.61, 36.50), (80.82, 78.70, 79.75),
        (80.36, 59.18, 68.16), (94.07, 73.23, 82.35), (83.00, 78.66, 80.77), (82.28, 75.14, 78.55)]),
    "promptsrc": (PROMPTSRC + ", Table 1", "PromptSRC README", [
        (77.60, 70.73, 74.01), (98.10, 94.03, 96.02), (95.33, 97.30, 96.30), (78.27, 74.97, 76.58),
        (98.07, 76.50, 85.95), (90.67, 91.53, 91.10), (42.73, 37.87, 40.15), (82.67, 78.47, 80.52),
        (83.37, 62.97, 71.75), (92.90, 73.90, 82.32), (87.10, 78.80, 82.74), (84.26, 76.10, 79.97)]),
}  # fmt: skip
# Means only, as MaPLe's model zoo lists them (its IVLP: 2+2 prompts; VPT: deep vision prompts), and
# HiCroPL's and CoPrompt's as their READMEs print them (HiCroPL's "Results on B2N" table; their
# per-dataset rows are in the papers, which could not be read here).
BASE_TO_NEW_MEANS = {
    "ivlp": (MAPLE + ", model zoo (README)", (82.15, 74.07, 77.90)),
    "vpt": (MAPLE + ", model zoo (README)", (80.24, 73.43, 76.68)),
    "hicropl": (HICROPL + ", Table 1; HiCroPL README", (85.89, 77.99, 81.75)),
    # the means its README reprints (ShuvenduRoy/CoPrompt); its per-dataset rows could not be read here
    "coprompt": (COPROMPT + ", Table 1; its README", (84.00, 77.23, 80.48)),
}

# TCP's, DePT's and MMRL's base-to-new means (16 shots, ViT-B/16; None: not quoted), unchecked:
# none of the repositories prints a table (DePT's README shows its tables as images) and the
# papers could not be read here. DePT's tests/results.csv holds 83.66 / 71.82 / 77.29 at lambda
# 0.7 without naming the method: the CoOp+DePT means quoted here.
BASE_TO_NEW_UNCHECKED = {
    "mmrl": (MMRL + ", Table 1", (None, None, 81.20)),
    "tcp": (TCP + ", Table 1", (84.13, 75.36, 79.51)),
    "coop+dept": (DEPT + ", Table 1", (83.66, 71.82, 77.29)),
    "kgcoop+dept": (DEPT + ", Table 1", (83.62, 75.04, 79.10)),
    "maple+dept": (DEPT + ", Table 1", (84.85, 74.82, 79.52)),
}

# Cross-dataset, trained on ImageNet: DATASETS_11 order (imagenet = source), then the target mean.
CROSS_DATASET = {
    "coop": (COCOOP + ", Table 2", [71.51, 93.70, 89.14, 64.51, 68.71, 85.30, 18.47, 64.15, 41.92, 46.39, 66.55, 63.88]),
    "cocoop": (COCOOP + ", Table 2", [71.02, 94.43, 90.14, 65.32, 71.88, 86.06, 22.94, 67.36, 45.73, 45.37, 68.21, 65.74]),
    "maple": (MAPLE + ", Table 2", [70.72, 93.53, 90.49, 65.57, 72.23, 86.20, 24.74, 67.01, 46.49, 48.06, 68.69, 66.30]),
    "promptsrc": (PROMPTSRC + ", Table 3", [71.27, 93.60, 90.25, 65.70, 70.25, 86.15, 23.90, 67.10, 46.87, 45.50, 68.75, 65.81]),
}  # fmt: skip
# Domain generalisation, trained on ImageNet: imagenet (source), then DG_TARGETS; and whether the
# four targets were checked (PromptAlign's README reprints them for CoOp, CoCoOp and MaPLe).
DOMAIN_GENERALIZATION = {
    "zeroshot": (COCOOP + ", Table 3", [66.73, 60.83, 46.15, 47.77, 73.96], False),
    "coop": (COCOOP + ", Table 3", [71.51, 64.20, 47.99, 49.71, 75.21], True),
    "cocoop": (COCOOP + ", Table 3", [71.02, 64.07, 48.75, 50.63, 76.18], True),
    "maple": (MAPLE + ", Table 3", [70.72, 64.07, 49.15, 50.90, 76.98], True),
    "promptsrc": (PROMPTSRC + ", Table 4", [71.27, 64.35, 49.55, 50.90, 77.80], False),
}
# Few-shot means over the 11 datasets at 16 shots, quoted without a check.
FEW_SHOT_MEANS = {"zeroshot": 65.1, "coop": 79.9}
# Few-shot at 16 shots per dataset, DATASETS_11 order, then the paper's mean; quoted without a
# check against the table (the repository's README only plots them, few_shot.png, which agrees).
FEW_SHOT_16 = {
    "clip_lora": (
        CLIP_LORA + ", Table 1",
        [73.6, 96.4, 92.4, 86.3, 98.0, 84.2, 54.7, 76.1, 72.0, 92.1, 86.7, 83.0],
    ),
}


# Tip-Adapter's few-shot curves, RN50 (its only backbone there), seed 1 of its own sampling: per
# dataset in DATASETS_11 order, accuracy at 16, 8, 4, 2, 1 shots. Tip-Adapter-F's figures are its
# code's max(best epoch on the TEST set, final after the val search); ours keep the last epoch.
TIP_SHOTS = (16, 8, 4, 2, 1)
TIP_FEW_SHOT = {
    "tip_adapter": [
        (62.01, 61.45, 60.98, 60.96, 60.70), (90.18, 89.83, 89.39, 88.44, 87.18),
        (88.14, 87.03, 86.45, 87.03, 86.10), (66.77, 62.93, 61.45, 57.93, 57.54),
        (89.89, 87.98, 83.80, 79.13, 73.12), (77.83, 77.76, 77.54, 77.52, 77.42),
        (29.76, 25.59, 22.41, 21.21, 19.05), (66.85, 65.62, 64.15, 62.70, 61.30),
        (60.93, 58.63, 53.96, 49.47, 46.22), (70.54, 67.95, 65.32, 61.68, 54.38),
        (70.58, 68.68, 66.46, 64.74, 62.60)],
    "tip_adapter_f": [
        (65.51, 64.00, 62.52, 61.69, 61.13), (92.86, 91.44, 90.56, 89.74, 89.33),
        (89.70, 88.09, 87.54, 87.03, 87.00), (75.74, 69.25, 64.57, 61.50, 58.86),
        (94.80, 91.51, 88.83, 82.30, 79.98), (79.43, 78.64, 78.24, 77.81, 77.51),
        (35.55, 30.21, 25.80, 23.19, 20.22), (71.47, 68.87, 66.21, 63.64, 62.50),
        (66.55, 62.71, 57.39, 53.72, 49.65), (84.54, 77.93, 74.12, 66.15, 59.53),
        (78.03, 74.25, 70.55, 66.43, 64.87)],
}  # fmt: skip


def _figures() -> list[Figure]:
    out = []
    for method, (source, checked_in, rows) in BASE_TO_NEW.items():
        for dataset, row in zip((*DATASETS_11, "average"), rows, strict=True):
            for metric, value in zip(("accuracy", "new_accuracy", "hm"), row, strict=True):
                if dataset == "average":  # the means are reprinted in `checked_in`
                    out.append(
                        Figure(method, "base_to_new", dataset, metric, value, f"{source}; {checked_in}", True)
                    )
                else:
                    out.append(Figure(method, "base_to_new", dataset, metric, value, source, False))
    for method, (source, row) in BASE_TO_NEW_MEANS.items():
        for metric, value in zip(("accuracy", "new_accuracy", "hm"), row, strict=True):
            out.append(Figure(method, "base_to_new", "average", metric, value, source, True))
    for method, (source, row) in BASE_TO_NEW_UNCHECKED.items():
        for metric, value in zip(("accuracy", "new_accuracy", "hm"), row, strict=True):
            if value is not None:
                out.append(Figure(method, "base_to_new", "average", metric, value, source, False))
    for method, (source, row) in CROSS_DATASET.items():
        for dataset, value in zip((*DATASETS_11, "average"), row, strict=True):
            out.append(
                Figure(method, "cross_dataset", dataset, "accuracy", value, source, dataset == "average")
            )
    for method, (source, row, targets_checked) in DOMAIN_GENERALIZATION.items():
        for dataset, value in zip(("imagenet", *DG_TARGETS), row, strict=True):
            checked = targets_checked and dataset != "imagenet"
            out.append(Figure(method, "domain_generalization", dataset, "accuracy", value, source, checked))
    for method, value in FEW_SHOT_MEANS.items():
        out.append(
            Figure(method, "few_shot", "average", "accuracy", value, COOP + ", few-shot results", False)
        )
    for method, rows in TIP_FEW_SHOT.items():
        for dataset, row in zip(DATASETS_11, rows, strict=True):
            for shots, value in zip(TIP_SHOTS, row, strict=True):
                out.append(Figure(method, "few_shot", dataset, "accuracy", value, TIP, True, shots, "RN50"))
    for method, (source, row) in FEW_SHOT_16.items():
        for dataset, value in zip((*DATASETS_11, "average"), row, strict=True):
            out.append(Figure(method, "few_shot", dataset, "accuracy", value, source, False))
    return out


FIGURES: list[Figure] = _figures()
_INDEX = {(f.method, f.protocol, f.dataset, f.metric, f.shots, f.model): f for f in FIGURES}
# Base-to-new checked sources, for the docs: where each checked mean was read.
CHECKED_IN = {m: checked_in for m, (_, checked_in, _) in BASE_TO_NEW.items()}


def lookup(
    method: str,
    protocol: str,
    dataset: str,
    metric: str = "accuracy",
    shots: int = 16,
    model: str = "ViT-B-16",
) -> Figure | None:
    """The published figure for this method, protocol, dataset and metric, or None.

    Args:
        method: our `method` name (e.g. "coop", "zeroshot", "maple"; "maple+dept" for DePT on MaPLe).
        protocol: one of `PROTOCOLS`.
        dataset: a dataset name, or "average" for the paper's mean.
        metric: "accuracy" (base accuracy for base-to-new), "new_accuracy" or "hm".
        shots: shots per class.
        model: the backbone's `coop.config.run_names.model_tag` ("ViT-B-16", "RN50").
    """
    return _INDEX.get((method, protocol, dataset, metric, shots, model))
