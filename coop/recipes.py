"""Each method's recipe: the values of its original code's configs where they differ from CoOp's.

`coop.config.load_config` applies `METHOD_DEFAULTS[method]` to every key that no file, override or
saved config sets; `YIELDS_TO` names the defaults that step back when another key is set; `DATASET_DEFAULTS` holds
a method's per-dataset values (applied over `METHOD_DEFAULTS`, under every file and override).
"""

# The recipes of the original code, applied where no layer sets the key:
# CoCoOp's vit_b16_c4_ep10_batch1_ctxv1 and KgCoOp's vit_b16_ep100_ctxv1 (both SGD lr 0.002 with
# CoOp's schedule, as in DEFAULTS); the MaPLe repository's VPT vit_b16_c2_ep5_batch4_4, IVLP
# vit_b16_c2_ep5_batch4_2+2ctx and MaPLe vit_b16_c2_ep5_batch4_2ctx, and the PromptSRC repository's
# vit_b16_c2_ep20_batch4_4+4ctx (the same SGD, warm-up and cosine; their PREC=fp16 is
# `train.precision=fp16`, the default here stays amp).
METHOD_DEFAULTS = {
    "cocoop": {"prompt.ctx_init": "a photo of a", "train.epochs": 10, "train.batch_size": 1},
    "kgcoop": {"prompt.ctx_init": "a photo of a", "train.epochs": 100, "train.batch_size": 128},
    "vpt": {
        "vision.n_ctx": 8,
        "vision.depth": 12,
        "train.lr": 0.0025,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
    "ivlp": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 12,
        "vision.n_ctx": 2,
        "vision.depth": 12,
        "train.lr": 0.0035,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
    "promptsrc": {
        "prompt.n_ctx": 4,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "vision.n_ctx": 4,
        "vision.depth": 9,
        "train.lr": 0.0025,
        "train.epochs": 20,
        "train.batch_size": 4,
    },
    "maple": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "train.lr": 0.0035,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
    # MMRL's configs/trainers/MMRL/vit_b16.yaml (base-to-new): AdamW lr 1e-3, wd 5e-4 (Dassl's
    # default), one constant warm-up epoch at 1e-5 then Dassl's cosine, batch 4, 10 epochs,
    # RandomResizedCrop scale (0.5, 1); PREC=amp. Its 5 tokens of width 512, layers 6..12 and
    # alpha 0.7 are the `mmrl.*` defaults.
    "mmrl": {
        "train.optimizer": "adamw",
        "train.lr": 0.001,
        "train.weight_decay": 0.0005,
        "train.epochs": 10,
        "train.batch_size": 4,
        "train.crop_scale": [0.5, 1.0],
    },
}
# Per-dataset recipe values, applied where no file or override sets the key. MMRL's
# trainers/config.py table (merged in the original over the yaml file and under the command
# line): the regulariser weight lambda per dataset, and d_r = 2048 for EuroSAT; its scripts run
# ImageNet with vit_b16_imagenet.yaml (batch 32, 5 epochs) for base-to-new and few-shot.
DATASET_DEFAULTS = {
    "mmrl": {
        "stanford_cars": {"mmrl.reg_weight": 7.0},
        "fgvc_aircraft": {"mmrl.reg_weight": 6.0},
        "sun397": {"mmrl.reg_weight": 6.0},
        "dtd": {"mmrl.reg_weight": 6.0},
        "food101": {"mmrl.reg_weight": 5.0},
        "oxford_flowers": {"mmrl.reg_weight": 4.0},
        "ucf101": {"mmrl.reg_weight": 3.0},
        "imagenet": {"mmrl.reg_weight": 0.5, "train.batch_size": 32, "train.epochs": 5},
        "caltech101": {"mmrl.reg_weight": 0.5},
        "oxford_pets": {"mmrl.reg_weight": 0.2},
        "eurosat": {"mmrl.reg_weight": 0.01, "mmrl.rep_dim": 2048},
    },
}
# A method default not applied when the other key is set: a default context phrase fixes M in
# CoCoOp and KgCoOp, so it yields to an explicit prompt.n_ctx (CoCoOp's c4/c8/c16 configs: M
# random vectors). IVLP and MaPLe set both, as their configs do (the phrase applies for n_ctx <= 4).
YIELDS_TO = {
    "cocoop": {"prompt.ctx_init": "prompt.n_ctx"},
    "kgcoop": {"prompt.ctx_init": "prompt.n_ctx"},
}
