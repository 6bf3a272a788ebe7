"""The typed configuration (`coop.config.schema`): every key's type, set and range is refused in one
line that names the key and the value; saved run configs still load; the tools refuse bad values
before they create anything, and a sweep's dry run checks every point against the model."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, TINY_CONFIG, run_tool_in_process
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from coop.config.checks import ConfigError
from coop.config.load import flatten, load_config, to_yaml
from coop.config.recipes import DATASET_RECIPES, METHOD_DEFAULTS
from coop.config.schema import DEFAULTS, SPECS, RunConfig
from coop.config.spec import check_values


def refusal(*overrides: str, path: str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "override, message",
    [
        ("prompt.csc=maybe", "prompt.csc must be true or false, got 'maybe' in command line"),
        ("prompt.csc=None", "prompt.csc must be true or false, got 'None' in command line"),
        ("data.skip_corrupt=None", "data.skip_corrupt must be true or false, got 'None' in command line"),
        ("train.cache_features=maybe", "train.cache_features must be true or false, got 'maybe' in command line"),
        ("train.grad_checkpointing=None", "train.grad_checkpointing must be true or false, got 'None' in command line"),
        ("fl.iid=maybe", "fl.iid must be true or false, got 'maybe' in command line"),
        ("fl.iid=2", "fl.iid must be true or false, got 2 in command line"),  # OmegaConf alone: true
        ("train.momentum=abc", "train.momentum must be a number >= 0, got 'abc' in command line"),
        ("train.momentum=-5", "train.momentum must be a number >= 0, got -5.0"),
        ("train.weight_decay=-5", "train.weight_decay must be a number >= 0, got -5.0"),
        ("data.seed=abc", "data.seed must be an integer >= 0, got 'abc' in command line"),
        ("data.seed=-5", "data.seed must be an integer >= 0, got -5"),
        ("data.seed=1.5", "data.seed must be an integer >= 0, got 1.5 in command line"),
        ("prompt.n_ctx=abc", "prompt.n_ctx must be an integer >= 1 or null, got 'abc' in command line"),
        ("train.lr=nan", "train.lr must be a number > 0, got nan"),
        ("train.betas=[0.9,abc]", "train.betas must be a list of 2 numbers in [0, 1), got 'abc' at train.betas[1]"),
        ("train.betas=[0.9]", "train.betas must be a list of 2 numbers in [0, 1), got [0.9]"),
        ("lora.layers=[1,1]", "lora.layers must be one of all, half-up, half-bottom or a non-empty list of distinct"),
        ("lora.layers=5", "lora.layers must be one of all, half-up, half-bottom or a non-empty list of distinct"),
        ("mmrl.layers=[3,2]", "mmrl.layers must be a non-empty increasing list of integers >= 1 or null, got [3, 2]"),
        ("eval.targets=dtd", "eval.targets must be a list of non-empty strings, got 'dtd'"),
        ("data.name=[dtd]", "data.name must be a string, got ['dtd'] in command line"),
    ],
)  # fmt: skip
def test_the_issue_values_are_one_line_errors(override, message):
    assert refusal(override).startswith(message)


def test_the_values_that_the_issue_wants_kept_still_load():
    cfg = load_config(None, ["prompt.csc=true", "train.epochs=null", "prompt.ctx_init=null", "data.seed=0"])
    assert cfg.prompt.csc is True and cfg.train.epochs is None and cfg.prompt.ctx_init is None
    cfg = load_config(None, ["fl.iid=true", "train.momentum=0", "lora.layers=[0,11]", "mmrl.layers=[6,12]"])
    assert cfg.fl.iid is True and cfg.train.momentum == 0.0 and list(cfg.lora.layers) == [0, 11]
    assert load_config(None, ["lora.layers=half-up"]).lora.layers == "half-up"
    assert isinstance(load_config(None, ["train.lr=1"]).train.lr, float)  # typed: 1 -> 1.0


def _outside(spec) -> object | None:
    """A value just outside `spec`'s declared range (None when it has none)."""
    rule = spec.rule
    if not rule:
        return None
    if rule == "finite":
        return "inf"
    step = 1 if "int" in (spec.kind, spec.item) else 0.5
    if rule.startswith(">="):
        return float(rule[2:]) - step if step != 1 else int(float(rule[2:])) - 1
    if rule.startswith(">"):
        return float(rule[1:])
    low, high = (float(v) for v in rule[4:-1].split(","))
    if rule[3] == "(":
        return low
    return high if rule[-1] == ")" else high + step


def _text(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_key_refuses_a_value_of_another_type_set_or_range_and_takes_its_default(key):
    spec, default = SPECS[key], flatten(DEFAULTS)[key]
    bad = []
    if spec.kind == "bool":
        bad += ["maybe", "None", "3", "1", "'true'"]  # a quoted word is a string
    if spec.kind in ("int", "float"):
        bad += ["abc", "[1]"]
    if spec.kind == "int":
        bad.append("1.5")
    if spec.kind == "str":
        bad += ["[a]", "{a: 1}"] + (["nope"] if spec.choices else [])
    if spec.kind == "list":
        bad.append("{a: 1}")
        if spec.choices:
            bad.append("[nope]")
    if not spec.optional and spec.kind != "any":
        bad.append("null")
    outside = _outside(spec)
    if outside is not None:
        if spec.kind in ("list", "any"):
            items = list(default) if isinstance(default, list) and default else [1]
            bad.append(_text([outside, *items[1:]]))
        else:
            bad.append(_text(outside))
    assert bad, f"{key} declares nothing to refuse"
    for value in bad:
        assert refusal(f"{key}={value}").startswith(f"{key} must be "), (key, value)
    assert spec.accepts(OmegaConf.select(OmegaConf.structured(RunConfig), key))  # its default
    if spec.optional:
        assert OmegaConf.select(load_config(None, [f"{key}=null"]), key) is None


def test_the_schema_is_the_defaults_and_its_config_is_typed():
    assert set(SPECS) == set(flatten(DEFAULTS))
    cfg = load_config()
    assert check_values(cfg, SPECS) is None
    with pytest.raises(ValidationError):
        cfg.prompt.csc = "maybe"  # a typed node refuses it after loading too
    with pytest.raises(ConfigError, match="^unknown or invalid config key 'prompt.colour' in command line$"):
        load_config(None, ["prompt.colour=red"])
    assert refusal("prompt=3").startswith("cannot merge command line: ")


def test_each_config_is_its_own_copy_of_the_schema():
    """load_config merges its layers into its own copy of the schema in place (no copy per layer):
    a config changed after loading leaves the schema and every other config as they were."""
    from coop.config.load import SCHEMA

    first = load_config(str(REPO / "configs" / "coop" / "vit_b16.yaml"), ["data.shots=4"])
    second = load_config(None, ["data.shots=4"])
    first.data.shots, first.prompt.ctx_init = 8, "a photo of a"
    first.train.betas[0] = 0.5
    assert second.data.shots == 4 and second.prompt.ctx_init == DEFAULTS["prompt"]["ctx_init"]
    assert list(second.train.betas) == DEFAULTS["train"]["betas"] == list(SCHEMA.train.betas)
    assert OmegaConf.to_container(SCHEMA) == DEFAULTS
    assert OmegaConf.to_container(load_config()) == DEFAULTS
    with pytest.raises(ValidationError):
        second.data.shots = "many"  # the copy keeps the schema's types


def test_a_failing_interpolation_is_selects_error():
    """check_values reads the resolved config at once; where an interpolation fails it reads key by
    key, so the error is OmegaConf.select's, naming the key (not the first node to_container meets)."""
    from coop.config.load import SCHEMA

    cfg = OmegaConf.merge(SCHEMA, {"model": {"name": "${nokey}"}})
    with pytest.raises(Exception) as expected:
        OmegaConf.select(cfg, "model.name")
    with pytest.raises(type(expected.value)) as got:
        check_values(cfg, SPECS)
    assert str(got.value) == str(expected.value) and "full_key: model.name" in str(got.value)
    with pytest.raises(type(expected.value), match="Interpolation key 'nokey' not found"):
        load_config(None, ["model.name=${nokey}"])


@pytest.mark.parametrize(
    "recipe",
    [*METHOD_DEFAULTS.items(), *((f"{m}/{d}", r) for m, t in DATASET_RECIPES.items() for d, r in t.items())],
    ids=lambda r: r if isinstance(r, str) else "",
)
def test_every_recipe_value_is_within_its_key(recipe):
    _, values = recipe
    for key, value in values.items():
        assert key in SPECS and SPECS[key].accepts(value), (key, value)


def test_a_file_value_names_the_key_and_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prompt:\n  csc: maybe\n")
    assert refusal(path=str(path)) == f"prompt.csc must be true or false, got 'maybe' in {path}"
    path.write_text("data:\n  seed: 1\ntrain:\n  momentum: -1\n")
    assert refusal(path=str(path)) == "train.momentum must be a number >= 0, got -1.0"


def test_saved_run_configs_still_load():
    """A run's config.yaml (and a checkpoint's config) is the base of resume and eval; one from
    before a key existed, with integers where numbers are now typed, loads to the same values."""
    cfg = load_config(None, ["method=tip_adapter", "data.shots=4", "prompt.n_ctx=8"])
    saved = yaml.safe_load(to_yaml(cfg))
    assert OmegaConf.to_container(load_config(None, [], base=saved)) == OmegaConf.to_container(cfg)
    old = yaml.safe_load(to_yaml(cfg))
    del old["fedpgp"], old["train"]["dist_backend"]  # written before these keys existed
    old["train"]["lr"], old["tip"]["search_scale"] = 1, [7, 3]  # integers in number keys
    loaded = load_config(None, [], base=old)
    assert loaded.train.lr == 1.0 and list(loaded.tip.search_scale) == [7.0, 3.0]
    assert loaded.fedpgp.rank == DEFAULTS["fedpgp"]["rank"] and loaded.train.dist_backend == "auto"
    old["prompt"]["csc"] = "maybe"
    with pytest.raises(
        ConfigError, match="^prompt.csc must be true or false, got 'maybe' in the saved run config$"
    ):
        load_config(None, [], base=old)


def test_train_refuses_a_bad_value_before_creating_the_run_folder(image_folder, tmp_path):
    from conftest import tiny_args

    out = tmp_path / "run"
    templates = "'coop', 'kgcoop', 'coop_ensemble', 'ensemble' or a template containing '{}'"
    for bad, message in (
        (["prompt.csc=maybe"], "error: prompt.csc must be true or false, got 'maybe' in command line"),
        (["prompt.depth=4"], "error: prompt.depth must be in 1..3 (the text tower's layers), got 4"),
        (["method=tcp"], "error: tcp.layer must be in 1..2 (the text tower's blocks), got 8"),
        (["method=zeroshot", "zeroshot.templates=a photo"], f"error: zeroshot.templates='a photo' is not one of {templates}"),
    ):  # fmt: skip
        res = run_tool_in_process(REPO / "tools" / "train.py", [*tiny_args(image_folder, out), *bad])
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [message], res.stderr[-2000:]
        assert not out.exists()  # no config.yaml, log.txt or .lock for collect.py to list


def test_sweep_dry_run_checks_every_point_against_the_model(tmp_path):
    grid = tmp_path / "depth.yaml"
    grid.write_text(f"model.name: {TINY_CONFIG}\nmodel.pretrained: none\nprompt.depth: [1, 3, 4]\n")
    res = run_tool_in_process(
        REPO / "tools" / "sweep.py", ["--grid", grid, "--out", tmp_path / "runs", "--dry-run"]
    )
    limit = "prompt.depth must be in 1..3 (the text tower's layers), got 4"
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: 1 of 3 points are refused (listed above)"
    ]
    assert res.stdout.strip().splitlines()[2].endswith(f"prompt.depth=4  ({limit})")
    res = run_tool_in_process(REPO / "tools" / "sweep.py", ["--grid", grid, "--out", tmp_path / "runs"])
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: point prompt.depth=4: {limit}"
    ]
    grid.write_text(f"model.name: {TINY_CONFIG}\nmodel.pretrained: none\nprompt.depth: [1, 3]\n")
    res = run_tool_in_process(
        REPO / "tools" / "sweep.py", ["--grid", grid, "--out", tmp_path / "runs", "--dry-run"]
    )
    assert res.returncode == 0 and "depth3" in res.stdout + res.stderr, res.stderr[-2000:]
    grid.write_text(f"model.name: {TINY_CONFIG}\nprompt.csc: [false, maybe]\n")
    res = run_tool_in_process(
        REPO / "tools" / "sweep.py", ["--grid", grid, "--out", tmp_path / "runs", "--dry-run"]
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: point prompt.csc=maybe: prompt.csc must be true or false, got 'maybe' in command line"
    ]
    assert not (tmp_path / "runs").exists()


def test_the_model_limits_cover_each_method():
    from coop.train.preflight import check_model_limits

    tiny = [f"model.name={TINY_CONFIG}"]
    for overrides, message in (
        (["method=maple", "prompt.depth=3"], "prompt.depth=3 is above the image tower's 2 layers"),
        (["method=ivlp", "prompt.depth=2", "vision.depth=3"], r"vision.depth must be in 1..2 \(the image tower's layers\), got 3"),
        (["method=mmrl", "mmrl.layers=[2,4]"], r"mmrl.layers=\[2, 4\] names block 4, and the tower has 3 blocks"),
        (["method=mmrl", "mmrl.vision_layers=[3]"], "names block 3, and the tower has 2 blocks"),
        (["method=clip_lora", "lora.layers=[2]"], "of the vision tower's 2 blocks"),
        (["method=tcp", "tcp.layer=3"], r"tcp.layer must be in 1..2 \(the text tower's blocks\), got 3"),
        (["method=tcp", "prompt.position=middle"], r"method=tcp builds its own prompt: prompt.position=end"),
        (["method=vpt", "vision.n_ctx=null"], r"method=vpt needs vision.n_ctx \(an integer >= 1\)"),
        (["method=kgcoop", "kgcoop.templates=texture"], "kgcoop.templates='texture' is not one of 'coop'"),
        (["method=promptsrc", "prompt.depth=2", "vision.depth=2", "promptsrc.templates=nope"], "promptsrc.templates='nope' is not 'promptsrc'"),
        (["method=tip_adapter", "tip.templates=nope"], "tip.templates='nope' is not one of 'coop'"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            check_model_limits(load_config(None, [*tiny, *overrides]))
    for overrides in (
        ["prompt.depth=3"],
        ["method=zeroshot", "prompt.depth=9"],
        ["method=tcp", "tcp.layer=2"],
        ["method=kgcoop", "kgcoop.templates=a {} texture."],
    ):
        check_model_limits(load_config(None, [*tiny, *overrides]))  # within the towers, or not read


def test_base_to_new_refuses_what_scores_only_its_own_classes():
    from coop.train.preflight import check_base_to_new

    base = ["data.subsample_classes=base"]
    for overrides, what in (
        (["method=linear_probe"], "method=linear_probe learns one classifier row per base class"),
        (["method=kgcoop", "prompt.csc=true"], "prompt.csc=true learns context for the base classes only"),
        (["method=maple", "prompt.csc=true"], "prompt.csc=true learns context for the base classes only"),
    ):
        with pytest.raises(ConfigError, match=f"^{what} and cannot score the new classes"):
            check_base_to_new(load_config(None, [*base, *overrides]))
    check_base_to_new(load_config(None, [*base, "method=vpt", "prompt.csc=true"]))  # no text context
    check_base_to_new(load_config(None, ["method=linear_probe", "prompt.csc=true"]))  # every class


def test_federated_checks_refuse_a_depth_above_the_tower():
    from coop.federated.task import check_config

    cfg = load_config(None, [f"model.name={TINY_CONFIG}", "train.aug_views=1", "prompt.depth=4"])
    with pytest.raises(
        ConfigError, match=r"^prompt.depth must be in 1..3 \(the text tower's layers\), got 4$"
    ):
        check_config(cfg)


def test_an_empty_model_pretrained_is_refused_not_random_weights():
    """OmegaConf reads `model.pretrained=` as null, which would train on random weights unasked."""
    with pytest.raises(
        ConfigError, match="^model.pretrained= is empty: give an open_clip tag or a weights file"
    ):
        load_config(None, ["model.pretrained="])
    assert load_config(None, ["model.pretrained=none"]).model.pretrained == "none"
