"""The config rules that involve several keys (`check_rules`). Each key's own type, set and range
are declared in its schema (`coop.config.schema`) and checked there; each rule here raises a
one-line ConfigError that names the keys and their values.
"""

from __future__ import annotations

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key or file."""


DEPT_HOSTS = ("coop", "cocoop", "kgcoop", "maple")  # coop.methods.dept


def check_depth(
    key: str, depth: int, layers: int | None, tower: str, error: type[ValueError] = ConfigError
) -> None:
    """`error` (ConfigError for a run config; a module's own error for its arguments) unless
    `depth` (the blocks a key prompts, e.g. prompt.depth) is in 1..`layers`, the block count of the
    `tower` ("text" or "image"); None: a tower whose count is not known."""
    if layers is not None and not 1 <= depth <= layers:
        raise error(f"{key} must be in 1..{layers} (the {tower} tower's layers), got {depth}")


def epochs_for_shots(shots: int, dataset: str) -> int:
    """CoOp's schedule: 50 epochs for 1 shot, 100 for 2-4, 200 for 8-16 (and all data); ImageNet 50."""
    if dataset == "imagenet":
        return 50
    if shots == 1:
        return 50
    if 2 <= shots <= 4:
        return 100
    return 200


def resolved_epochs(cfg: DictConfig) -> int:
    if cfg.train.epochs is not None:
        return int(cfg.train.epochs)
    return epochs_for_shots(int(cfg.data.shots), cfg.data.name)


def check_rules(cfg: DictConfig) -> None:
    """Every rule between keys, for a config whose keys each hold a valid value."""
    check_length(cfg)
    t = cfg.train
    if not t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr must be a number in [0, train.lr={t.lr}], got {t.min_lr!r}")
    if t.epochs == 0 and cfg.method in ("coop", "kgcoop") and not cfg.prompt.ctx_init:
        raise ConfigError(
            "train.epochs=0 evaluates untrained prompts: set prompt.ctx_init (e.g. 'a photo of a')"
        )
    split_file = cfg.data.split_file
    if split_file is not None and cfg.data.name != "imagefolder":
        raise ConfigError(
            f"data.split_file={split_file!r} is read by data.name=imagefolder only (got {cfg.data.name!r}); "
            "set data.split_file=null for other datasets"
        )
    if cfg.data.fewshot_source == "jsonl" and cfg.data.shots < 1:
        raise ConfigError(
            "data.fewshot_source=jsonl reads 2SFS's K-shot split files: set data.shots to their K (1, 2, 4, 8, 16)"
        )
    if cfg.method == "maple":
        for key in ("n_ctx", "depth"):
            value, text = cfg.vision[key], cfg.prompt[key]
            if value is not None and value != text:
                raise ConfigError(
                    f"vision.{key}={value} conflicts with prompt.{key}={text}: maple couples its vision "
                    f"prompts to the text prompts and takes their count and depth from prompt.{key}"
                )
    if cfg.dept.enabled and cfg.method not in DEPT_HOSTS:
        raise ConfigError(f"dept.enabled=true wraps method={'|'.join(DEPT_HOSTS)}, got method={cfg.method}")


def check_length(cfg: DictConfig) -> None:
    """The run's length is set in one unit (epochs, iterations or iterations per shot), and the
    warm-up is shorter than the epochs."""
    t = cfg.train
    if t.iterations is not None and t.iterations_per_shot is not None:
        raise ConfigError(
            f"train.iterations={t.iterations} and train.iterations_per_shot={t.iterations_per_shot} "
            "both set the run's length; set one of them to null"
        )
    iterations = t.iterations is not None or t.iterations_per_shot is not None
    if iterations and t.epochs is not None:
        raise ConfigError(
            f"train.epochs={t.epochs} and train.iterations{'' if t.iterations else '_per_shot'} both set "
            "the run's length; set train.epochs=null"
        )
    epochs, warmup = resolved_epochs(cfg), t.warmup_epochs
    # with iterations the warm-up is checked by coop.train.schedule.plan_schedule
    if epochs > 0 and warmup >= epochs and not iterations:
        raise ConfigError(
            f"train.warmup_epochs={warmup} must be less than the {epochs} training epochs "
            f"(train.epochs={t.epochs}), or the cosine schedule never starts"
        )
