"""Run folder names: `<dataset>/<model>/shots<K>/<settings>/seed<S>`, CoOp's script layout, with
the settings part naming what each method's results depend on.

    run_name(cfg)  # "dtd/ViT-B-16/shots16/nctx16_cscfalse_posend_depth1/seed1"
    tta_run_name(cfg)  # "dtd/ViT-B-16/tta_zero/zeroshot_template-1a2b3c4d_views64/seed1"
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def model_tag(name: str) -> str:
    """A folder-safe model name: "ViT-B/16" -> "ViT-B-16", "cfg/tiny.json" -> "tiny"."""
    if name.endswith(".json"):
        name = Path(name).stem
    return name.replace("/", "-")


def method_settings(cfg: DictConfig) -> str:
    """The settings part of a run name: what the method's results depend on (`_settings`), and
    "_poolprompts" with `vision.pool_prompts=true`."""
    pool = "_poolprompts" if OmegaConf.select(cfg, "vision.pool_prompts", default=False) else ""
    return _settings(cfg) + pool


def _settings(cfg: DictConfig) -> str:
    """The settings part of a run name but for `vision.pool_prompts`.

    coop: nctx<M>_csc<C>_pos<P>_depth<J>; cocoop, kgcoop, ivlp, maple, promptsrc and tcp: the same
    after "<method>_" (M is "init" when the context starts from prompt.ctx_init), ivlp and promptsrc followed by
    _vctx<N>_vdepth<K> (`vision.*`); vpt: vpt_vctx<N>_vdepth<K>; zeroshot: zeroshot_<templates>
    (a literal template by its hash); linear_probe: linear_probe; tip_adapter and tip_adapter_f:
    <method>_views<tip.augment_epochs>; 2sfs: 2sfs_<peft>_<towers>_s<stage_one> then, for ln and
    bitfit, _from<text_start>-<vision_start>, for lora CLIP-LoRA's settings; mmrl: mmrl_k<K>_dr<d_r>_l<layers>_vl<vision layers>_a<alpha>_lam<lambda>;
    coprompt: as maple, followed by _w<coprompt.weight>.
    DePT (`dept.enabled`) adds "_dept".
    """
    if cfg.method == "zeroshot":
        templates = str(cfg.zeroshot.templates)
        if templates not in ("coop", "kgcoop", "coop_ensemble", "ensemble"):
            templates = "template-" + hashlib.sha1(templates.encode()).hexdigest()[:8]
        return f"zeroshot_{templates}"
    if cfg.method == "linear_probe":
        return "linear_probe"
    if cfg.method in ("tip_adapter", "tip_adapter_f"):
        return f"{cfg.method}_views{cfg.tip.augment_epochs}"
    if cfg.method == "clip_lora":
        lora = cfg.lora
        layers = lora.layers if isinstance(lora.layers, str) else "-".join(str(i) for i in lora.layers)
        towers, targets = "+".join(lora.towers), "".join(lora.targets)
        return f"clip_lora_r{lora.rank}_a{lora.alpha:g}_drop{lora.dropout:g}_{towers}_{targets}_{layers}"
    if cfg.method == "2sfs":
        t = cfg.twosfs
        name = f"2sfs_{t.peft}_{'+'.join(t.towers)}_s{t.stage_one:g}"
        if t.peft == "lora":
            lora = cfg.lora
            layers = lora.layers if isinstance(lora.layers, str) else "-".join(str(i) for i in lora.layers)
            return (
                f"{name}_r{lora.rank}_a{lora.alpha:g}_drop{lora.dropout:g}_{''.join(lora.targets)}_{layers}"
            )
        return f"{name}_from{t.text_start}-{t.vision_start}"
    if cfg.method == "mmrl":
        m = cfg.mmrl
        layers = "-".join(map(str, m.layers)) if m.layers is not None else "auto"
        vision_layers = "-".join(map(str, m.vision_layers)) if m.vision_layers is not None else "auto"
        return f"mmrl_k{m.n_tokens}_dr{m.rep_dim}_l{layers}_vl{vision_layers}_a{m.alpha}_lam{m.reg_weight}"
    vision = f"vctx{cfg.vision.n_ctx}_vdepth{cfg.vision.depth}"
    if cfg.method == "vpt":
        return f"vpt_{vision}"
    p = cfg.prompt
    n_ctx = p.n_ctx if p.n_ctx is not None else ("init" if p.ctx_init else 4)
    pos = "middle" if p.position == "mid" else p.position
    prefix = "" if cfg.method == "coop" else f"{cfg.method}_"
    text = f"{prefix}nctx{n_ctx}_csc{str(bool(p.csc)).lower()}_pos{pos}_depth{p.depth}"
    text = f"{text}_{vision}" if cfg.method in ("ivlp", "promptsrc") else text
    text = f"{text}_w{cfg.coprompt.weight:g}" if cfg.method == "coprompt" else text
    return f"{text}_dept" if cfg.dept.enabled else text


def run_name(cfg: DictConfig) -> str:
    """CoOp-style run folder: <dataset>/<model>/shots<K>/<settings>/seed<S>.

    The settings part is `method_settings` (for CoOp nctx<M>_csc<C>_pos<P>_depth<J>); runs without
    augmentation (train.augment=false) add "_noaug", base-to-new runs (data.subsample_classes
    base/new) "_base"/"_new", runs on 2SFS's split files (data.fewshot_source=jsonl) "_jsonl".
    """
    classes = "" if cfg.data.subsample_classes == "all" else f"_{cfg.data.subsample_classes}"
    augment = "" if cfg.train.augment else "_noaug"  # never one folder for both
    source = "_jsonl" if cfg.data.fewshot_source == "jsonl" else ""  # 2SFS's images, not our draw
    return (
        f"{cfg.data.name}/{model_tag(cfg.model.name)}/shots{cfg.data.shots}/"
        f"{method_settings(cfg)}{augment}{classes}{source}/seed{cfg.data.seed}"
    )


def tta_run_name(cfg: DictConfig) -> str:
    """A test-time pass's folder (`coop.tta`): <dataset>/<model>/tta_<method>/<host>_views<V>/seed<S>.

    V is `tta.views`, or "-own" where it is null (the method's original's number for the dataset).
    The host is the settings part of its run name (`method_settings`), followed for a run or export
    (`tta.init`) by _init-<8 hex digits of its path>; a `tta.augment` other
    than the method's own adds "_<augment>"; a base-to-new split "_base"/"_new".
    """
    t = cfg.tta
    host = (
        method_settings(cfg)
        if t.init is None
        else "init-" + hashlib.sha1(str(t.init).encode()).hexdigest()[:8]
    )
    augment = "" if t.augment is None else f"_{t.augment}"
    classes = "" if cfg.data.subsample_classes == "all" else f"_{cfg.data.subsample_classes}"
    return (
        f"{cfg.data.name}/{model_tag(cfg.model.name)}/tta_{t.method}/"
        f"{host}_views{'-own' if t.views is None else t.views}{augment}{classes}/seed{cfg.data.seed}"
    )
