"""Methods behind one interface (`coop.methods.base.Method`); `cfg.method` picks one.

from coop.methods import build_method
method = build_method(clip, classnames, cfg)

The methods layer: may import coop.model, coop.data, coop.config and the root modules. Imported
by: coop.train, coop.results, coop.federated, coop.interop and the tools. `gpa.py` holds
PromptSRC's Gaussian prompt aggregation (used by `promptsrc.py` alone).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from coop.methods.base import Method, TransferError
from coop.methods.clip_lora import CLIPLoRA
from coop.methods.cocoop import CoCoOp, MetaNet
from coop.methods.coop import CoOp, build_learner
from coop.methods.coprompt import CoPrompt
from coop.methods.dept import DePT
from coop.methods.hicropl import HiCroPL
from coop.methods.ivlp import IVLP
from coop.methods.kgcoop import KgCoOp
from coop.methods.linear_probe import LinearProbe
from coop.methods.maple import MaPLe
from coop.methods.mmrl import MMRL
from coop.methods.promptsrc import PromptSRC
from coop.methods.tcp import TCP
from coop.methods.tip_adapter import TipAdapter, TipAdapterF
from coop.methods.twosfs import TwoSFS
from coop.methods.vpt import VPT, VisionPromptMethod
from coop.methods.zeroshot import COOP_TEMPLATES, ZeroShot, resolve_templates, template_features
from coop.model.clip import CLIP

METHODS: dict[str, type[Method]] = {
    "coop": CoOp,
    "cocoop": CoCoOp,
    "kgcoop": KgCoOp,
    "zeroshot": ZeroShot,
    "linear_probe": LinearProbe,
    "vpt": VPT,
    "ivlp": IVLP,
    "maple": MaPLe,
    "promptsrc": PromptSRC,
    "tip_adapter": TipAdapter,
    "tip_adapter_f": TipAdapterF,
    "clip_lora": CLIPLoRA,
    "mmrl": MMRL,
    "tcp": TCP,
    "hicropl": HiCroPL,
    "2sfs": TwoSFS,
    "coprompt": CoPrompt,
}


def build_method(clip: CLIP, classnames: list[str], cfg: DictConfig) -> Method:
    """The method named by `cfg.method`, built for `classnames` (wrapped by DePT with `dept.enabled`)."""
    name = cfg.method
    if name not in METHODS:
        raise ValueError(f"method={name!r} is not one of {', '.join(METHODS)}")
    method = METHODS[name](clip, classnames, cfg)
    if OmegaConf.select(cfg, "dept.enabled", default=False):
        method = DePT(method, cfg)  # DePT's head and FiLM around the host
    return method


__all__ = [
    "COOP_TEMPLATES",
    "CLIPLoRA",
    "METHODS",
    "CoCoOp",
    "CoOp",
    "CoPrompt",
    "DePT",
    "HiCroPL",
    "IVLP",
    "KgCoOp",
    "LinearProbe",
    "MaPLe",
    "MMRL",
    "Method",
    "MetaNet",
    "PromptSRC",
    "TipAdapter",
    "TipAdapterF",
    "TCP",
    "TwoSFS",
    "TransferError",
    "VPT",
    "VisionPromptMethod",
    "ZeroShot",
    "build_learner",
    "build_method",
    "resolve_templates",
    "template_features",
]
