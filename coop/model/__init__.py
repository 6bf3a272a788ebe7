"""The model layer: CLIP's two towers and what they are made of, and the prompts that enter them.

blocks.py (attention, MLP, residual blocks), packing.py (the packed pass), inserted.py (tokens
inserted at later blocks), lora.py (low-rank adapters), text_encoder.py (the text tower),
text_support.py (which open_clip text towers ours reproduces: TextConfig, text_support),
text_full.py and text_packed.py (the text tower's full-sequence and packed passes),
image_tower.py (the image tower's one forward, with the tokens methods add) and its two back ends,
image_encoder.py (open_clip's ViT) and image_timm.py (timm's ViT and EVA trunks), clip.py (the
CLIP wrapper and cosine logits), weights.py (load_clip), tokenizer.py (the tokenizer, offline, as
prompts see it, and whether it fits the model), tiny_tokenizers.py (tiny offline Hugging Face
tokenizers for the tiny configs and tests), prompt.py (PromptLearner, PromptClassifier), support.py
(which of open_clip's models take prompts in which tower), errors.py (ModelError, which any layer
catches without importing a tower).

May import: coop.config and the root modules (coop.io, coop.versions). Imported by: coop.methods,
coop.reference, coop.train, coop.results, coop.interop, coop.federated and the tools.
"""
