"""Step-by-step reference computations on OpenCLIP's own modules, one module per method family.

This is what the original code computes, slow on purpose: ground truth for the tests and the
baseline of `tools/bench/bench_text.py`, `tools/bench/bench_cocoop.py` and `tools/bench/bench_vl.py`.

- `coop.py`: CoOp's and CoCoOp's prompts at the full context length through open_clip's text
  modules (deep prompts too), and that full-length text side for the vision-language methods;
- `vision_prompts.py`: VPT, IVLP and MaPLe; `promptsrc.py`: PromptSRC's loss;
- `tip_adapter.py`, `clip_lora.py`, `mmrl.py`, `tcp.py`, `dept.py`, `twosfs.py`: the later methods;
- `text_parts.py`: a family's text modules and pooled token; `vision.py`: image features with
  vision prompts on open_clip's ViT; `timm_vit.py`: the same on open_clip's timm towers, through
  timm's own forward with hooks.

Beside coop.methods: may import coop.model, coop.config and the root modules. Imported by the
tests and the benchmarks only.
"""
