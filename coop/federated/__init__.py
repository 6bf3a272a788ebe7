"""Federated prompt learning on Flower: PromptFL and latent-domain prompts.

Flower (`pip install 'coop[federated]'`) is imported only by the modules that need it, so
`import coop` works without it. Entry point: `tools/federated.py`.
"""
