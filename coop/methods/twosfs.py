"""2SFS: two-stage few-shot adaptation (Farina, Mancini, Iacca & Ricci, CVPR 2025).

As FarinaMatteo/rethinking_fewshot_vlms computes it (`fs/twostage.py`, `fs/utils/model_utils.py`):
a budget of T steps (`train.iterations_per_shot` M = 300 times the shots) is split at
S = int(alpha T), alpha = `twosfs.stage_one` (0.6). With y the batch's labels:

    stage one, steps t < S: what `twosfs.peft` names trains (the towers' LayerNorms)
        text   = text tower on "a photo of a {class}." for every training class          (n_cls, E)
        image  = image tower on the augmented batch                                     (B, E)
        logits = logit_scale.exp() * norm(image) @ norm(text).T;   loss = CE(logits, y)
    at step S, once: W = norm(text) of the adapted text tower                           (n_cls, E)
    stage two, steps t >= S: stage one's tensors frozen, the head W trains
        image  = adapted image tower on the augmented batch, without gradient           (B, E)
        logits = logit_scale.exp() * norm(image) @ norm(W).T;      loss = CE(logits, y)
    test (selective inference): a class with a row in W scores with that row, any other class
        with the adapted text tower's features of its prompt:
        logits = logit_scale.exp() * norm(image) @ norm([W_c or text_c for every class c]).T

Stage one (`twosfs.peft`):
    ln    the weight and bias of every LayerNorm inside the blocks of each tower in
          `twosfs.towers`, from block `twosfs.text_start` / `twosfs.vision_start` on. The original's
          `trainable_norm_params` also lists ln_pre, ln_post and ln_final but, meeting each twice in
          its module walk, sets them back to requires_grad=False: they never train, here neither.
    lora  CLIP-LoRA's adapters (`coop.model.lora`: `lora.rank`, `alpha`, `dropout`, `targets`,
          `layers`) on the towers in `twosfs.towers` (the original's `--encoder`).
    bitfit  BitFit: the biases its `trainable_bias_params` picks (`block_biases`).

Each stage has an AdamW of its own (lr 2e-4, weight decay 1e-2) and its own CosineAnnealingLR to
1e-6 over its steps. Here one AdamW holds both stages' tensors and only the current stage's have
gradients, so the other's are skipped (no moment, no decay): the head's moments start at step S as
a new optimizer's would, and the schedule restarts its cosine at S (`restart_step`,
`coop.train.schedule.Schedule.restart`). The stage (a buffer in `learnable`) and the step count
(`training_state`) are in every checkpoint, so a run killed anywhere resumes into the right stage.
Both stages run in training mode, as the original's: with `peft=lora` the head's initial rows and the
second stage's image features are computed with the adapters' dropout on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from coop.config.checks import ConfigError
from coop.methods.base import Method, TowerLayers, TransferError
from coop.methods.clip_lora import encode_template, layer_spec, layers_tag, lora_adapters, template_ids
from coop.model.clip import CLIP, cosine_logits
from coop.model.errors import ModelError
from coop.model.lora import LoRAAdapters, LoRAError, resolve_layers

PREFIX = {"text": "text.", "vision": "visual."}  # learned tensors' names: the tower's key in open_clip


def is_layer_norm(module: nn.Module) -> bool:
    """An `nn.LayerNorm`, or a class named so that is not one: mT5's `T5LayerNorm` (an RMS norm
    with a weight only), the one norm of its text tower's layers."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("LayerNorm")


def block_norms(tower: nn.Module, start: int, prefix: str) -> dict[str, nn.Parameter]:
    """The weight and bias of every LayerNorm (`is_layer_norm`) inside `tower.blocks[start:]`, named
    `prefix` plus their key in the tower's state dict (e.g. "visual.transformer.resblocks.0.ln_1.weight")."""
    keys = {id(p): k for k, p in tower.named_parameters()}
    found = {}
    for block in list(tower.blocks)[start:]:
        for module in block.modules():
            if is_layer_norm(module):
                for p in module.parameters(recurse=False):
                    found[prefix + keys[id(p)]] = p
    return found


def block_biases(tower: nn.Module, start: int, prefix: str) -> dict[str, nn.Parameter]:
    """BitFit's tensors as the original's `trainable_bias_params` picks them: the `bias` of every
    module inside `tower.blocks[start:]` that has one (not the packed q|k|v `in_proj_bias` of
    open_clip's attention, which is named otherwise), and the biases of the tower's ln_post and
    ln_final, and of ln_pre when start is 0 (its walk gives ln_pre block 0, the others the
    tower's block count); named as `block_norms` names them."""
    keys = {id(p): k for k, p in tower.named_parameters()}
    modules = [m for block in list(tower.blocks)[start:] for m in block.modules()]
    modules += [
        m
        for name, m in tower.named_modules()
        if "ln_post" in name or "ln_final" in name or ("ln_pre" in name and start == 0)
    ]
    biases = [getattr(m, "bias", None) for m in modules]
    return {prefix + keys[id(b)]: b for b in biases if isinstance(b, nn.Parameter)}


class TwoSFS(Method):
    """2SFS: the towers' LayerNorms (or LoRA) for stage one, then a linear head on the adapted
    features, initialised from the adapted text features; at test time the head scores its classes
    and the adapted text tower every other class.

    Args:
        clip: a `coop.CLIP`; with "vision" in `twosfs.towers` its image tower must be one of our
            `ImageTower`s (a ViT: open_clip's or a timm trunk).
        classnames: as for every method.
        cfg: reads `twosfs.*`, `lora.*` (peft=lora) and `train.grad_checkpointing`.
    """

    name = "2sfs"
    trainer = "sgd"
    input = "pixels"

    @classmethod
    def image_tower_use(cls, cfg: DictConfig) -> str | None:
        if "vision" not in cfg.twosfs.towers:
            return None
        return {
            "ln": "tunes the LayerNorms of the image tower's blocks (twosfs.towers)",
            "bitfit": "tunes the biases of the image tower's blocks (twosfs.towers)",
        }.get(cfg.twosfs.peft, "adapts the image tower (twosfs.towers)")

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """fp16 refused (the LayerNorms train in fp32 under autocast, as the original's); each tuned
        tower's first block (peft=ln) or `lora.layers` (peft=lora) within its blocks."""
        super().check_config(cfg, towers)  # an image tower that is not a ViT of ours: refused
        t = cfg.twosfs
        if cfg.train.precision == "fp16":
            raise ConfigError(
                "method=2sfs trains the towers' own tensors in fp32 under autocast, as the original; "
                "train.precision=fp16 would make them half: use amp or fp32"
            )
        for tower in t.towers:
            blocks = towers.text if tower == "text" else towers.image
            if blocks is None:
                continue  # a tower whose block count is not known here: checked when built
            if t.peft != "lora":
                start = int(t[f"{tower}_start"])
                if start >= blocks:
                    raise ConfigError(
                        f"twosfs.{tower}_start={start} must be a block of the {tower} tower's {blocks} "
                        f"(0..{blocks - 1})"
                    )
                continue
            try:
                resolve_layers(layer_spec(cfg), blocks, tower)
            except LoRAError as e:
                raise ConfigError(str(e)) from None

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        t = cfg.twosfs
        self.peft, self.fraction = str(t.peft), float(t.stage_one)
        self.tuned = [tower for tower in ("text", "vision") if tower in t.towers]
        self.settings = {"twosfs_peft": self.peft, "twosfs_towers": "+".join(self.tuned)}
        self.settings["twosfs_stage_one"] = self.fraction
        self.adapters: LoRAAdapters | None = None
        if self.peft != "lora":
            self.stage_one = self.tuned_tensors(clip, t)
        else:
            lora = cfg.lora
            self.adapters = lora_adapters(clip, self.tuned, cfg)
            self.stage_one = self.adapters.tensors()
            self.settings.update(lora_rank=int(lora.rank), lora_layers=layers_tag(lora.layers))
        self.head = nn.Parameter(torch.zeros(self.n_cls, clip.embed_dim, device=self.device))
        self.register_buffer("stage", torch.ones((), dtype=torch.long, device=self.device))
        self.steps = 0  # optimizer steps taken (training_state)
        self.switch: int | None = None  # S, from `restart_step`: the runner's budget
        self.grad_checkpointing = bool(OmegaConf.select(cfg, "train.grad_checkpointing", default=False))
        ids, eos, self.prefix = template_ids(clip, self.classnames)
        self.register_buffer("token_ids", ids, persistent=False)  # (n_cls, L)
        self.register_buffer("eos", eos, persistent=False)
        self._frozen_text: torch.Tensor | None = None  # the text tower not tuned: computed once
        self.set_stage(1)

    def tuned_tensors(self, clip: CLIP, t: DictConfig) -> dict[str, nn.Parameter]:
        """peft=ln: the tuned towers' block LayerNorms (`block_norms`); bitfit: their biases
        (`block_biases`); a ModelError for a tower that has none from its start block on."""
        pick, what = (block_norms, "LayerNorms") if self.peft == "ln" else (block_biases, "biases")
        tensors = {}
        for tower in self.tuned:
            module = clip.text if tower == "text" else clip.visual
            found = pick(module, int(t[f"{tower}_start"]), PREFIX[tower])
            if not found:
                raise ModelError(
                    f"method=2sfs tunes the {what} of the {tower} tower's blocks, and model "
                    f"{clip.name}'s {type(module).__name__} has none from block {t[f'{tower}_start']} on"
                )
            tensors.update(found)
        return tensors

    @property
    def device(self) -> torch.device:
        return self.clip.logit_scale.device

    def set_stage(self, stage: int) -> None:
        """Stage 1: stage one's tensors require grad, the head not; stage 2 the other way round."""
        self.stage.fill_(stage)
        for p in self.stage_one.values():
            p.requires_grad_(stage == 1)
        self.head.requires_grad_(stage == 2)

    def learnable(self) -> dict[str, torch.Tensor]:
        return {**self.stage_one, "head": self.head, "stage": self.stage}

    def param_groups(self) -> list[dict]:
        """Both stages' tensors in one group: the stage not training has no gradients, so AdamW
        skips its tensors (`set_stage`)."""
        return [{"params": [*self.stage_one.values(), self.head]}]

    def restart_step(self, total: int) -> int:
        """S = int(alpha T), as the original's `cosine_iters`: the first step of stage two."""
        self.switch = int(total * self.fraction)
        return self.switch

    def training_state(self) -> dict:
        return {"steps": self.steps}

    def load_training_state(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """Stage one's tensors and the stage as saved; the head keeps one row per class of
        `classnames` (the training classes), whatever classes this method scores (`prepare`)."""
        own = self.learnable()
        if set(tensors) != set(own):
            raise TransferError(
                f"{self.name} expects tensors {sorted(own)}, the checkpoint has {sorted(tensors)}"
            )
        with torch.no_grad():
            for key, saved in tensors.items():
                if key == "head" and saved.shape != self.head.shape:
                    self.head.data = saved.to(self.head.device, self.head.dtype).clone()
                    continue
                if own[key].shape != saved.shape:
                    raise TransferError(
                        f"{self.name}: saved {key} has shape {tuple(saved.shape)}, expected {tuple(own[key].shape)}"
                    )
                own[key].copy_(saved)
        self.set_stage(int(self.stage))

    def encode(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(n, E) unnormalised features of the classes `rows` (all: None) through the text tower as
        it is now; the shared prefix once unless LoRA's dropout draws a mask per token."""
        ids, eos = (self.token_ids, self.eos) if rows is None else (self.token_ids[rows], self.eos[rows])
        masks = self.adapters is not None and self.adapters.draws_masks("text")
        return encode_template(self.clip.text, ids, eos, 0 if masks else self.prefix)

    def text_features(self) -> torch.Tensor:
        """Every class's text features; computed once when the text tower is not tuned."""
        if "text" in self.tuned:
            return self.encode()
        if self._frozen_text is None:
            with torch.no_grad():
                self._frozen_text = self.encode()
        return self._frozen_text

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, E) of the image tower; with gradients only where stage one tunes it."""
        if "vision" in self.tuned and int(self.stage) == 1 and torch.is_grad_enabled():
            return self.clip.encode_image(images, grad_checkpointing=self.grad_checkpointing)
        with torch.no_grad():
            return self.clip.encode_image(images)

    def start_stage_two(self) -> None:
        """W = the adapted text tower's normalised features of the training classes; then only W trains."""
        with torch.no_grad():
            self.head.copy_(F.normalize(self.encode().float(), dim=-1))
        self.set_stage(2)

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training and torch.is_grad_enabled():  # one call per optimizer step
            if self.steps == self.switch and int(self.stage) == 1:
                self.start_stage_two()
            self.steps += 1
        image = self.image_features(images)
        text = self.text_features() if int(self.stage) == 1 else self.head
        logits = cosine_logits(image, text, self.clip.logit_scale)
        return F.cross_entropy(logits, labels), logits

    def prepare(self) -> torch.Tensor:
        """The classifier (n_cls, E): before stage two the text features of every class; then the
        head's row of every class it has one for, the text tower's features for the others."""
        if int(self.stage) == 1:
            return self.text_features()
        where = {name: i for i, name in enumerate(self.trained_classnames)}
        rows = [where.get(name, -1) for name in self.classnames]
        known = [i for i, r in enumerate(rows) if r >= 0]
        missing = [i for i, r in enumerate(rows) if r < 0]
        out = torch.empty(self.n_cls, self.head.shape[1], device=self.device)
        if known:
            out[known] = self.head[[rows[i] for i in known]].detach().float()
        if missing:
            out[missing] = self.encode(torch.tensor(missing, device=self.device)).float()
        return out

    def logits(self, images: torch.Tensor, prepared=None) -> torch.Tensor:
        classifier = self.prepare() if prepared is None else prepared
        return cosine_logits(self.image_features(images), classifier, self.clip.logit_scale)

    def describe(self) -> dict:
        return dict(self.settings)
