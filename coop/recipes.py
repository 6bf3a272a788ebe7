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
    # TCP's configs/trainers/TCP/vit_b16_ep100_ctxv1 (despite its name MAX_EPOCH 50) with its script's
    # N_CTX 4: Adam lr 0.002 with the eps 1e-3 that its README patches into Dassl, wd 5e-4, batch 32,
    # one constant warm-up epoch at 1e-5, then cosine.
    "tcp": {"prompt.n_ctx": 4, "train.optimizer": "adam", "train.eps": 1e-3, "train.epochs": 50},
    # DePT (`dept.enabled=true`) on its hosts: the DePT repository's configs/trainers/ExtrasLinearProbe*
    # merged over its train.py `extend_cfg` (SGD, staged lr x6.5 for the head and FiLM, 10 epochs).
    # CoOp: N_CTX 16 random (extend_cfg), lr 0.0035, batch 4; CoCoOp: CoCoOp's prompt, lr 0.002,
    # batch 1; KgCoOp: "a photo of a", W 2.0, lr 0.0035, batch 4; MaPLe: 2 ctx, depth 9, lr 0.0035, batch 4.
    "coop+dept": {"prompt.n_ctx": 16, "train.lr": 0.0035, "train.epochs": 10, "train.batch_size": 4},
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
