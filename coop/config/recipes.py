"""Each method's recipe: the values of its original code's configs where they differ from CoOp's.

`coop.config.load.load_config` applies `METHOD_DEFAULTS[method]`, updated by
`DATASET_RECIPES[method][dataset]` where an original's configs differ per dataset, to every key
that no file, override or saved config sets; `YIELDS_TO` names the defaults that step back when
another key is set.
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
    # CoPrompt's configs/trainers/coprompt.yaml (MaPLe's prompts, W 1.0, 8 epochs; Dassl's SGD, cosine
    # and constant warm-up epoch at 1e-5; PREC=fp16, here amp) and its K_TRANSFORMS 2 views of
    # Resize + RandAugment(2, 10) ("randaugment", "normalize"); per dataset below.
    "coprompt": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "coprompt.weight": 1.0,
        "train.transform": "randaugment",
        "train.lr": 0.0035,
        "train.epochs": 8,
        "train.batch_size": 4,
    },
    # Tip-Adapter (gaopengcuhk/Tip-Adapter, main.py and utils.py): the cache keys average 10 views
    # of RandomResizedCrop(scale 0.5-1, bicubic) + flip; the search grids have 200 x 20 points.
    "tip_adapter": {"train.crop_scale": [0.5, 1.0]},
    # Tip-Adapter-F trains the keys with AdamW(lr 0.001, eps 1e-4, PyTorch's weight decay 0.01),
    # CosineAnnealingLR(T_max = train_epoch * len(loader)) stepped every iteration down to 0, no
    # warm-up, batch 256 with the last, smaller batch kept, 20 epochs (EuroSAT 100, below).
    "tip_adapter_f": {
        "train.crop_scale": [0.5, 1.0],
        "train.optimizer": "adamw",
        "train.lr": 0.001,
        "train.eps": 1e-4,
        "train.weight_decay": 0.01,
        "train.schedule": "cosine_iter",
        "train.min_lr": 0.0,
        "train.warmup_epochs": 0,
        "train.batch_size": 256,
        "train.drop_last": False,
        "train.epochs": 20,
    },
    # CLIP-LoRA's main.py/lora.py/run_utils.py: the same values for every dataset and shot count.
    "clip_lora": {
        "train.optimizer": "adamw",
        "train.lr": 2e-4,
        "train.weight_decay": 1e-2,
        "train.betas": [0.9, 0.999],
        "train.schedule": "cosine_iter",
        "train.min_lr": 1e-6,
        "train.warmup_epochs": 0,
        "train.iterations_per_shot": 500,
        "train.batch_size": 32,
    },
    # 2SFS's main.py defaults and fs/twostage.py, the same for every dataset and shot count: AdamW
    # lr 2e-4, wd 1e-2, betas (0.9, 0.999), batch 32 with the last, smaller batch kept, M = 300
    # iterations per shot, a CosineAnnealingLR to 1e-6 per stage stepped every iteration (restarted
    # at stage two: coop.methods.twosfs), no warm-up; the split alpha = 0.6 is `twosfs.stage_one`.
    "2sfs": {
        "train.optimizer": "adamw",
        "train.lr": 2e-4,
        "train.weight_decay": 1e-2,
        "train.betas": [0.9, 0.999],
        "train.schedule": "cosine_iter",
        "train.min_lr": 1e-6,
        "train.warmup_epochs": 0,
        "train.iterations_per_shot": 300,
        "train.batch_size": 32,
        "train.drop_last": False,
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
    # TCP's configs/trainers/TCP/vit_b16_ep100_ctxv1 (despite its name MAX_EPOCH 50) with its script's
    # N_CTX 4: Adam lr 0.002 with the eps 1e-3 that its README patches into Dassl, wd 5e-4, batch 32,
    # one constant warm-up epoch at 1e-5, then cosine. ImageNet and SUN397: 25 epochs (DATASET_RECIPES).
    "tcp": {
        "prompt.n_ctx": 4,
        "prompt.ctx_init": None,
        "train.optimizer": "adam",
        "train.eps": 1e-3,
        "train.epochs": 50,
    },
    # HiCroPL's configs/trainers/HiCroPL/vit_b16_c2_ep50_batch32_16ctx (its base-to-new and few-shot
    # scripts): N_CTX 16 (above 4, so random context, "X X ... {class}."), PROMPT_DEPTH 12,
    # CROSS_LAYER 6, LAMBD 12; Adam lr 0.0025 with eps 1e-3, wd 5e-4 (Dassl's default), batch 32,
    # 50 epochs, one constant warm-up epoch at 1e-5, then cosine. ImageNet: ep40_batch128
    # (DATASET_RECIPES). Its PREC=fp16 is `train.precision=fp16`; the default here stays amp.
    "hicropl": {
        "prompt.n_ctx": 16,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 12,
        "hicropl.cross_layer": 6,
        "hicropl.weight": 12.0,
        "train.optimizer": "adam",
        "train.lr": 0.0025,
        "train.eps": 1e-3,
        "train.epochs": 50,
        "train.batch_size": 32,
    },
    # DePT (`dept.enabled=true`) on its hosts: the DePT repository's configs/trainers/ExtrasLinearProbe*
    # merged over its train.py `extend_cfg` (SGD, staged lr x6.5 for the head and FiLM, 10 epochs).
    # CoOp: N_CTX 16 random (extend_cfg), lr 0.0035, batch 4; CoCoOp: CoCoOp's prompt, lr 0.002,
    # batch 1; KgCoOp: "a photo of a", W 2.0, lr 0.0035, batch 4; MaPLe: 2 ctx, depth 9, lr 0.0035, batch 4.
    "coop+dept": {
        "prompt.n_ctx": 16,
        "prompt.ctx_init": None,
        "train.lr": 0.0035,
        "train.epochs": 10,
        "train.batch_size": 4,
    },
    "cocoop+dept": {"prompt.ctx_init": "a photo of a", "train.epochs": 10, "train.batch_size": 1},
    "kgcoop+dept": {
        "prompt.ctx_init": "a photo of a",
        "kgcoop.weight": 2.0,
        "train.lr": 0.0035,
        "train.epochs": 10,
        "train.batch_size": 4,
    },
    "maple+dept": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "train.lr": 0.0035,
        "train.epochs": 10,
        "train.batch_size": 4,
    },
}

# Tip-Adapter's configs/<dataset>.yaml (the same file for 1 to 16 shots and both methods): init_beta,
# init_alpha, search_scale [beta, alpha] (search_step is [200, 20] everywhere); train_epoch 20
# except EuroSAT's 100. Its `fgvc` is our fgvc_aircraft. Datasets without a file (the ImageNet
# variants, imagefolder, textile) keep the `tip.*` defaults, which are ImageNet's.
TIP_SETTINGS = {  # dataset: (init_beta, init_alpha, [beta scale, alpha scale])
    "imagenet": (1.0, 1.17, [7, 3]),
    "caltech101": (1.0, 3.0, [12, 5]),
    "oxford_pets": (1.0, 1.17, [7, 3]),
    "stanford_cars": (1.0, 3.0, [20, 10]),
    "oxford_flowers": (1.0, 10.0, [50, 50]),
    "food101": (1.0, 1.17, [10, 10]),
    "fgvc_aircraft": (1.0, 5.0, [30, 30]),
    "sun397": (1.0, 1.17, [12, 10]),
    "dtd": (1.0, 2.0, [13, 13]),
    "eurosat": (1.0, 2.0, [12, 10]),
    "ucf101": (1.0, 3.0, [7, 3]),
}
_TIP = {
    dataset: {"tip.init_beta": beta, "tip.init_alpha": alpha, "tip.search_scale": scale}
    for dataset, (beta, alpha, scale) in TIP_SETTINGS.items()
}
# CoPrompt's trainers/constants.py `get_dataset_specified_config` (merged in its train.py after the
# config file and the command line): (prompt depth, n_ctx, W) per dataset; Food-101 trains 5
# epochs (its README tests it at --load-epoch 5, the others at 8).
COPROMPT_SETTINGS = {
    "imagenet": (12, 4, 8.0),
    "caltech101": (12, 4, 4.0),
    "oxford_pets": (12, 2, 0.1),
    "stanford_cars": (12, 4, 4.0),
    "oxford_flowers": (9, 4, 8.0),
    "food101": (9, 4, 0.5),
    "fgvc_aircraft": (9, 4, 2.0),
    "sun397": (12, 4, 8.0),
    "dtd": (12, 2, 8.0),
    "eurosat": (12, 2, 0.1),
    "ucf101": (12, 4, 2.0),
}
_COPROMPT = {
    dataset: {"prompt.depth": depth, "prompt.n_ctx": n_ctx, "coprompt.weight": weight}
    | ({"train.epochs": 5} if dataset == "food101" else {})
    for dataset, (depth, n_ctx, weight) in COPROMPT_SETTINGS.items()
}
# Per dataset, over METHOD_DEFAULTS and under every file and override. MMRL's: its
# trainers/config.py table (merged in the original over the yaml file and under the command
# line): the regulariser weight lambda per dataset, and d_r = 2048 for EuroSAT; its scripts run
# ImageNet with vit_b16_imagenet.yaml (batch 32, 5 epochs) for base-to-new and few-shot. TCP's:
# its train.py `setup_cfg` sets MAX_EPOCH 25 for ImageNet and SUN397 after the config file and
# the command line (its script tests them at `--load-epoch 25`, the last epoch).
DATASET_RECIPES = {
    "tip_adapter": _TIP,
    "tip_adapter_f": {**_TIP, "eurosat": {**_TIP["eurosat"], "train.epochs": 100}},
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
    "tcp": {"imagenet": {"train.epochs": 25}, "sun397": {"train.epochs": 25}},
    # HiCroPL's test script reads ImageNet's model from its vit_b16_c2_ep40_batch128_16ctx folder
    "hicropl": {"imagenet": {"train.epochs": 40, "train.batch_size": 128}},
    "coprompt": _COPROMPT,
}
# A method default not applied when the other key is set: a default context phrase fixes M in
# CoCoOp and KgCoOp, so it yields to an explicit prompt.n_ctx (CoCoOp's c4/c8/c16 configs: M
# random vectors). IVLP and MaPLe set both, as their configs do (the phrase applies for n_ctx <= 4).
YIELDS_TO = {
    "cocoop": {"prompt.ctx_init": "prompt.n_ctx"},
    "kgcoop": {"prompt.ctx_init": "prompt.n_ctx"},
    "coop+dept": {"prompt.n_ctx": "prompt.ctx_init"},  # a phrase (the protocol grids') fixes M
    "cocoop+dept": {"prompt.ctx_init": "prompt.n_ctx"},
    "kgcoop+dept": {"prompt.ctx_init": "prompt.n_ctx"},
}
