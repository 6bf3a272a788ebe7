"""The model layer: CLIP's two towers and what they are made of, and the prompts that enter them.

blocks.py (attention, MLP, residual blocks), packing.py (the packed pass), inserted.py (tokens
inserted at later blocks), lora.py (low-rank adapters), text_encoder.py and image_encoder.py (the
towers), text_support.py (which open_clip text towers ours reproduces: TextConfig, text_support),
text_full.py and text_packed.py (the text tower's full-sequence and packed passes), clip.py (the CLIP wrapper and cosine logits),
weights.py (load_clip), tokenizer.py (the tokenizer, offline, as prompts see it), prompt.py
(PromptLearner, PromptClassifier), support.py (which of open_clip's models take prompts in which
tower).

May import: coop.config and the root modules (coop.io). Imported by: coop.methods,
coop.reference, coop.train, coop.results, coop.interop, coop.federated and the tools.
"""
