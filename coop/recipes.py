"""Each method's recipe: the values of its original code's configs where they differ from CoOp's.

`coop.config.load_config` applies `METHOD_DEFAULTS[method]` to every key that no file, override or
saved config sets; `YIELDS_TO` names the defaults that step back when another key is set.
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
}
# A method default not applied when the other key is set: a default context phrase fixes M in
# CoCoOp and KgCoOp, so it yields to an explicit prompt.n_ctx (CoCoOp's c4/c8/c16 configs: M
# random vectors). IVLP and MaPLe set both, as their configs do (the phrase applies for n_ctx <= 4).
YIELDS_TO = {
    "cocoop": {"prompt.ctx_init": "prompt.n_ctx"},
    "kgcoop": {"prompt.ctx_init": "prompt.n_ctx"},
}
