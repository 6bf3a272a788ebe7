"""The benchmark tools and the GPU check, run end to end on the tiny model (CPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

import pytest
import torch
from conftest import REPO, TINY_CONFIG, small_timm_config


def load_tool(name):
    spec = importlib.util.spec_from_file_location(
        f"coop_tool_{name}", REPO / "tools" / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def two_blocks(monkeypatch, **trunk) -> None:
    """timm trunks built from here on keep 2 blocks (the tiny timm configs build 12), with `trunk`'s
    other arguments."""
    import functools

    import open_clip

    create = functools.partial(open_clip.timm_model.timm.create_model, depth=2, **trunk)
    monkeypatch.setattr(open_clip.timm_model.timm, "create_model", create)


def test_gpu_check_without_cuda_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_tool("gpu_check").main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == ["gpu_check: no CUDA device available; nothing checked"]
    assert not (tmp_path / "gpu_check.json").exists()


def small_timm_sections(monkeypatch, folder) -> list[str]:
    """gpu_check's timm sections on copies of its tiny timm configs at 112x112 images (8x8 patches of
    14, 7x7 of 16; the configs' 224 and 384 cost most of the script on a CPU), the trunks with 2
    blocks. Their names."""
    steps = sys.modules["_gpu_steps"]  # imported by gpu_check
    two_blocks(monkeypatch, img_size=112)
    models = [small_timm_config(m, folder, 112) for m in steps.TIMM_SIZES["maple"]["tiny"]["models"]]
    for sizes in steps.TIMM_SIZES.values():
        monkeypatch.setitem(sizes["tiny"], "models", tuple(str(m) for m in models))
    return [m.stem for m in models]


def test_gpu_check_runs_every_section_on_cpu(tmp_path, monkeypatch, capsys):
    gpu_check = load_tool("gpu_check")
    timm_models = small_timm_sections(monkeypatch, tmp_path)
    assert timm_models == ["eva02-tiny-112", "siglip-tiny-112", "pe-core-tiny-112"]
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["model"] == "coop-tiny" and report["device"] == "cpu"
    parity = {(r["position"], r["precision"]): r for r in report["parity"]}
    assert set(parity) == {(p, q) for p in ("end", "middle") for q in ("fp32", "bf16")}
    assert parity["end", "fp32"]["features"] < 1e-5 and parity["middle", "fp32"]["grad"] < 1e-4
    # bf16 really ran in bf16: both sides differ from fp32 by far more than fp32 rounding
    assert parity["end", "bf16"]["reference_features"] > 1e-4 and parity["end", "bf16"]["features"] > 1e-4
    speed = report["text_speed"]
    assert [(r["classes"], r["n_ctx"], r["precision"]) for r in speed] == [(10, 4, "fp32"), (10, 4, "bf16")]
    assert all(r["coop_ms"] > 0 and r["reference_ms"] > 0 for r in speed)
    bound = report["text_bound"]
    assert [(r["classes"], r["n_ctx"], r["position"]) for r in bound] == [
        (10, 4, p) for p in ("end", "middle", "front")
    ]
    assert [r["prefix"] for r in bound] == [5, 3, 1] and all(
        r["speedup"] > 0 and r["bound"] > 1 for r in bound
    )
    assert [r["side"] for r in report["memory"]] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["peak_mib"] is None for r in report["memory"])  # no CUDA: not measured
    epoch = report["epoch"]
    assert epoch["images"] == 64 and epoch["aug_views0_steps"] == epoch["cached_steps"] == 2
    assert epoch["cache_s"] > 0 and epoch["aug_views0_s"] > 0
    maple = report["maple"]
    assert [r["side"] for r in maple] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["ms"] > 0 and r["peak_mib"] is None and r["classes"] == 20 for r in maple)
    assert [r["side"] for r in report["clip_lora"]] == [r["side"] for r in maple]
    mmrl = report["mmrl"]
    assert [r["side"] for r in mmrl] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["ms"] > 0 and r["classes"] == 20 for r in mmrl)
    twosfs = report["twosfs"]
    assert [r["side"] for r in twosfs] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["ms"] > 0 and r["classes"] == 20 for r in twosfs)
    coprompt = report["coprompt"]
    assert [r["side"] for r in coprompt] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["ms"] > 0 and r["classes"] == 20 for r in coprompt)
    hicropl = report["hicropl"]
    assert [r["side"] for r in hicropl] == ["coop", "coop, grad checkpointing", "reference"]
    assert all(r["ms"] > 0 and r["classes"] == 20 for r in hicropl)
    timm_maple = report["timm_maple"]
    assert [(r["model"], r["side"]) for r in timm_maple] == [
        (m, s) for m in timm_models for s in ("coop", "coop, grad checkpointing", "reference")
    ]
    assert all(r["ms"] > 0 and r["peak_mib"] is None and r["classes"] == 20 for r in timm_maple)
    # CLIP-LoRA: three timed rows per model, or one row saying in one line why it does not run there
    lora = {m: [r for r in report["timm_clip_lora"] if r["model"] == m] for m in timm_models}
    for rows in lora.values():
        assert [r.get("side") for r in rows] in (["coop", "coop, grad checkpointing", "reference"], [None])
        assert all(r["ms"] > 0 for r in rows) if len(rows) == 3 else "\n" not in rows[0]["unsupported"]
    tpt = report["tpt"]
    assert [r["classes"] for r in tpt["per_image"]] == [10] and tpt["per_image"][0]["max_logit_diff"] < 1e-4
    assert all(tpt["per_image"][0][clock]["bound"] > 1 for clock in ("wall", "cpu"))
    assert [r["side"] for r in tpt["memory"]] == ["ours", "ours, grad checkpointing", "reference"]
    saved = {r["side"]: r["saved_mib"] for r in tpt["memory"]}
    assert saved["ours, grad checkpointing"] < saved["ours"] < saved["reference"]
    out = capsys.readouterr().out
    assert (
        "all checks passed" in out and "no decoding/augmentation" in out and "one MaPLe training step" in out
    )
    assert "TPT per image, ours vs the reference" in out


def test_gpu_check_keeps_going_after_a_failing_section(tmp_path, monkeypatch, capsys):
    gpu_check = load_tool("gpu_check")

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB\nmore details")

    monkeypatch.setattr(gpu_check, "check_parity", out_of_memory)
    monkeypatch.setattr(gpu_check, "check_speed", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_text_bound", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_memory", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_maple", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_clip_lora", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_mmrl", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_twosfs", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_coprompt", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_hicropl", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_timm", lambda *args: [])
    monkeypatch.setattr(gpu_check, "check_tpt", lambda *args: {"per_image": [], "memory": []})
    monkeypatch.setattr(gpu_check, "check_epoch", out_of_memory)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["errors"] == {
        "parity": "RuntimeError: CUDA out of memory. Tried to allocate 80.00 GiB",
        "epoch": "RuntimeError: CUDA out of memory. Tried to allocate 80.00 GiB",
    }
    assert report["text_speed"] == [] and report["memory"] == [] and not report["ok"]
    assert "all checks FAILED" in capsys.readouterr().out


def test_bench_tta_states_tpts_ratio_bound_and_memory(capsys):
    """Both sides per image on the tiny model, the same logits, the bound, the memory rows."""
    args = ["--model", str(TINY_CONFIG), "--classes", "6", "--images", "1", "--views", "10", "--memory"]
    assert load_tool("bench_tta").main(args) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"max \|logit diff\| (\S+)", out).group(1)) < 1e-4
    assert re.search(r"^\| 6 \| cpu \| [\d,]+ ms \| [\d,]+ ms \| \S+x \| \S+x \| \d+% \|$", out, re.M)
    assert "bound R / (B + F)" in out and "one TPT image at 6 classes" in out
    for side in ("ours", "ours, grad checkpointing", "reference"):
        assert re.search(rf"^  {re.escape(side)} +6 classes: saved for backward +[\d.]+ MiB", out, re.M)


def test_bench_text_compares_both_sides(capsys):
    assert (
        load_tool("bench_text").main(["--model", str(TINY_CONFIG), "--classes", "5", "--repeats", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "speed-up:" in out and "after 1 warm-up call(s) each" in out
    assert "times: best of 1 after 1 warm-up round(s), wall" in out  # the closing table: both sides' times
    assert re.search(
        r"^\| M=4, end \| 5 \| 77 / \([^)]+\) = \S+x \| [\d,]+ ms \| [\d,]+ ms \| \S+x \|", out, re.M
    )
    diff = float(re.search(r"max \|diff\| output: (\S+)", out).group(1))
    assert diff < 1e-5


@pytest.mark.parametrize(
    "text_cfg, bound",
    [
        ({"no_causal_mask": True, "pool_type": "last", "proj_bias": True}, r"bound 16 / 16\.00 = 1\.00x"),
        ({"embed_cls": True}, r"bound 17 / [\d.]+ = [\d.]+x"),
    ],
)
def test_bench_text_states_each_family_bound(text_cfg, bound, tmp_path, capsys):
    """A bidirectional tower (SigLIP's shape) runs its whole context, bound 1x; CoCa's class token
    keeps the cut: the reference computes context + 1 tokens per prompt."""
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1},
        "text_cfg": {"context_length": 16, "width": 32, "heads": 2, "layers": 2, **text_cfg},
        "custom_text": True,
    }
    if text_cfg.get("embed_cls"):
        cfg["multimodal_cfg"] = {"context_length": 16, "width": 32, "heads": 2, "layers": 1}
    path = tmp_path / f"family-{len(text_cfg)}.json"
    path.write_text(json.dumps(cfg))
    args = ["--model", str(path), "--classes", "3", "--repeats", "1", "--warmup", "0"]
    assert load_tool("bench_text").main(args) == 0
    out = capsys.readouterr().out
    assert re.search(bound, out), out
    assert float(re.search(r"max \|diff\| output: (\S+)", out).group(1)) < 1e-5


def test_bench_tcp_compares_both_sides_and_states_its_bound(capsys):
    args = ["--model", str(TINY_CONFIG), "--classes", "4", "--layer", "1", "--repeats", "1", "--warmup", "0"]
    assert load_tool("bench_tcp").main(args) == 0
    out = capsys.readouterr().out
    bound = re.search(r"own tokens per prompt and block (\S+); bound 77 / \S+ = (\S+)x", out)
    assert float(bound.group(2)) == pytest.approx(77 / float(bound.group(1)), rel=1e-2)
    assert float(re.search(r"max \|diff\| output: (\S+)", out).group(1)) < 1e-5
    grads = re.findall(r"(ctx|meta_net\.\S+) (\S+?)(?:,|$)", out.splitlines()[-1])
    assert len(grads) == 5 and all(float(d) < 1e-4 for _, d in grads)


def test_bench_federated_fedotp_step_equals_the_originals_way(capsys):
    args = ["--model", str(TINY_CONFIG), "--classes", "5", "--batch", "2", "--repeats", "1", "--json"]
    assert load_tool("bench_federated").main(args) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["classes"] == 5 and r["reference_s"] > 0 and r["coop_s"] > 0
    assert r["loss_rel_diff"] < 1e-5 and r["grad_rel_diff"] < 1e-4  # the same step, computed two ways


def test_bench_train_counts_steps(capsys):
    # 2 shots x 3 textile classes = 6 images; batch 4 drops the last partial batch: 1 step per epoch
    args = [
        "--model",
        str(TINY_CONFIG),
        "--shots",
        "2",
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--workers",
        "0",
    ]
    assert load_tool("bench_train").main(args) == 0
    out = capsys.readouterr().out
    assert "(2 steps in 2 epochs," in out.split("aug_views=0")[1].splitlines()[0]
    cached = next(line for line in out.splitlines() if line.startswith("epoch on cached"))
    assert "(2 steps in 2 epochs," in cached


def test_bench_vl_matches_the_reference_and_measures_memory(tmp_path, monkeypatch, capsys):
    out_json = tmp_path / "vl.json"
    args = ["--method", "maple", "--model", str(TINY_CONFIG), "--classes", "4", "--batch", "2"]
    args += ["--set", "prompt.depth=2", "--memory-classes", "4", "--json", str(out_json)]
    bench_vl = load_tool("bench_vl")
    assert bench_vl.main([*args, "--no-memory"]) == 0
    out = capsys.readouterr().out
    assert "speed-up:" in out and "bound from token counts" in out
    report = json.loads(out_json.read_text())
    step = report["steps"][0]
    assert step["classes"] == 4 and step["reference_text"] == 4 * 77 and step["ours_text"] < 4 * 77
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert set(step["grad_diff"]) == {"ctx", "deep_ctx", "proj.weight", "proj.bias"} | {
        f"compound_prompt_projections.0.{p}" for p in ("weight", "bias")
    }
    # what each child process of the memory measurement runs (here in this process)
    child = argparse.Namespace(
        device="cpu", model=str(TINY_CONFIG), memory_classes=4, batch=2, set=["prompt.depth=2"]
    )
    # (in a process that has already run steps, freed memory is reused: the added peak can be 0)
    assert bench_vl.step_memory(child, "maple", grad_checkpointing=True) >= 0
    # a step whose text graph would not fit in the free memory is skipped with its estimate, not run
    monkeypatch.setattr(bench_vl, "_available_gib", lambda: 0.0)
    assert bench_vl.step_memory(child, "maple", grad_checkpointing=False) is None
    assert "its text graph needs about" in capsys.readouterr().err
    assert bench_vl.step_memory(child, "maple", grad_checkpointing=True) >= 0  # checkpointed: not estimated


def test_bench_vl_clip_lora_matches_its_reference(tmp_path):
    out_json = tmp_path / "lora.json"
    args = ["--method", "clip_lora", "--model", str(TINY_CONFIG), "--classes", "4", "--batch", "2"]
    assert load_tool("bench_vl").main([*args, "--no-memory", "--json", str(out_json)]) == 0
    step = json.loads(out_json.read_text())["steps"][0]
    # the reference: 77 tokens per class; ours: the shared "[SOS] a photo of a" once, then each row to [EOS]
    assert step["reference_text"] == 4 * 77 and step["ours_text"] < 4 * 12
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert len(step["grad_diff"]) == (3 + 2) * 6  # A and B of q, k, v in every block of both towers


@pytest.mark.parametrize(
    "stem, trunk, context, image_tokens",
    [
        ("eva02-tiny", {}, 77, 1 + 16 * 16),
        ("siglip-tiny", {"class_token": False}, 64, 14 * 14),  # as SigLIP's own trunks
        ("pe-core-tiny", {}, 32, 1 + 24 * 24),
    ],
)
def test_bench_vl_maple_on_timm_towers_matches_timms_forward(
    stem, trunk, context, image_tokens, tmp_path, monkeypatch
):
    """MaPLe on EVA02 (RoPE), SigLIP (no class token, MAP pool, no causal mask) and PE-Core (RoPE,
    MAP pool, 32-token context): ours against the reference, whose image side is timm's own forward
    with the prompts as extra prefix tokens (`coop.reference.timm_vit`). The trunks keep 2 blocks."""
    two_blocks(monkeypatch, **trunk)
    out_json = tmp_path / "vl.json"
    model = str(REPO / "configs" / "models" / f"{stem}.json")
    args = ["--method", "maple", "--model", model, "--classes", "4", "--batch", "2", "--no-memory"]
    args += ["--set", "prompt.depth=2", "--warmup", "0", "--json", str(out_json)]
    assert load_tool("bench_vl").main(args) == 0
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["reference_text"] == 4 * context  # every prompt padded to the model's context
    assert step["image"] == 2 * (image_tokens + 2)  # the tower's own tokens and M = 2 prompts
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert {"ctx", "deep_ctx", "proj.weight", "compound_prompt_projections.0.weight"} <= set(
        step["grad_diff"]
    )


@pytest.mark.parametrize("method", ["vpt", "ivlp", "promptsrc"])
def test_bench_vl_other_vision_prompt_methods_on_a_timm_tower(method, tmp_path, monkeypatch):
    """VPT, IVLP and PromptSRC (its frozen image pass too) against their references on SigLIP's
    trunk without a class token, MAP-pooled; 2 blocks."""
    two_blocks(monkeypatch, class_token=False)
    out_json = tmp_path / "vl.json"
    args = ["--method", method, "--model", REPO / "configs/models/siglip-tiny.json", "--classes", "4"]
    args += ["--batch", "2", "--no-memory", "--warmup", "0", "--json", out_json]
    args += ["--set", "prompt.depth=2", "--set", "vision.depth=2"]
    assert load_tool("bench_vl").main([str(a) for a in args]) == 0
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert {"vision_ctx", "vision_deep_ctx"} <= set(step["grad_diff"])  # the prompts entered the tower
    if method == "promptsrc":
        assert max(step["term_diff"].values()) < 1e-5


def test_bench_vl_bad_input_is_one_line():
    """The tiny configs' text towers have 2-3 blocks: MaPLe's recipe depth 9 is refused in one line
    naming the key and the --set that lowers it, before anything is built; so are an unknown model, a
    missing config JSON, a refused text tower and RN50 (named as such) for a method that prompts its
    image tower."""
    from conftest import run_tool_in_process

    tool = REPO / "tools" / "bench" / "bench_vl.py"
    hf = (
        "model roberta-ViT-B-32's text tower is the Hugging Face model 'roberta-base', whose config is not in "
        "the Hugging Face cache and the hub cannot be reached (offline?): run once where there is network, or "
        "copy that machine's Hugging Face cache (HF_HOME)"
    )
    for model, message in (
        (REPO / "configs/models/eva02-tiny.json", "prompt.depth must be in 1..2 (the text tower's layers), got 9 "
         "(method=maple's recipe on model eva02-tiny: lower it with --set KEY=VALUE)"),
        ("ViT-Q-99", "unknown open_clip model 'ViT-Q-99' (see open_clip.list_models(), or pass a config .json)"),
        (REPO / "missing.json", f"model config file not found: {REPO / 'missing.json'}"),
        ("roberta-ViT-B-32", hf),
        ("RN50", "method=maple prompts the image tower, and model RN50's image tower is a ResNet (a CNN): it has "
         "no tokens, so it takes no vision prompts (CLIP-LoRA runs with lora.towers=[text])"),
    ):  # fmt: skip
        res = run_tool_in_process(tool, ["--method", "maple", "--model", model, "--no-memory"])
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"error: {message}"], res.stderr
        assert not res.stdout  # refused before the header: nothing was built


def test_bench_text_bad_model_is_one_line(tmp_path):
    """An unknown model, a missing config JSON and a Hugging Face text tower: one line, exit 2."""
    from conftest import run_tool_in_process

    for model, message in (
        ("ViT-Q-99", "unknown open_clip model 'ViT-Q-99'"),
        (tmp_path / "missing.json", f"model config file not found: {tmp_path / 'missing.json'}"),
        (
            "roberta-ViT-B-32",
            "model roberta-ViT-B-32's text tower is the Hugging Face model 'roberta-base', whose config",
        ),
    ):
        res = run_tool_in_process(
            REPO / "tools" / "bench" / "bench_text.py", ["--model", model, "--classes", "2"]
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), (
            res.stderr
        )


def test_bench_threads_times_the_demo_epoch_and_text_step_under_exactly_its_settings():
    bench = load_tool("bench_threads")
    r = bench.measure(epochs=2, repeats=1, classes=3, model=str(TINY_CONFIG))
    assert r["n_train"] == 48 and r["threads"] == torch.get_num_threads()  # textile at 16 shots
    assert r["epoch_s"] > 0 and r["text_s"] > 0
    # each measuring process: the setting's OpenMP variables alone, none added by the tools
    outer = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"}
    assert bench.child_env(bench.SETTINGS["OMP_WAIT_POLICY=PASSIVE"], outer) == {
        "PATH": "/bin",
        "OMP_WAIT_POLICY": "PASSIVE",
        "COOP_OMP_DEFAULTS": "0",
    }
    assert bench.child_env(bench.SETTINGS["torch's defaults"], outer) == {
        "PATH": "/bin",
        "COOP_OMP_DEFAULTS": "0",
    }


def test_bench_twosfs_compares_both_stages_and_states_its_bound(capsys):
    args = [
        "--model",
        str(TINY_CONFIG),
        "--classes",
        "3",
        "5",
        "--batch",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    assert load_tool("bench_twosfs").main(args) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"(\d+) classes: stage-one step: .* bound 77 / (\S+) = (\S+)x; stage-two step", out)
    assert [int(r[0]) for r in rows] == [3, 5]
    assert all(float(b) == pytest.approx(77 / float(own), rel=1e-2) for _, own, b in rows)
    diffs = re.findall(r"max \|diff\| loss: (\S+);.* step (\S+), text side (\S+)", out)
    assert len(diffs) == 2 and all(float(d) < 1e-4 for row in diffs for d in row)
    assert re.search(r"of one stage-one step: 2sfs \d+ MiB, reference \d+ MiB", out)
