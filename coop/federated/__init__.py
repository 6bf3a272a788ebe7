"""Federated prompt learning on Flower: PromptFL, latent-domain prompts, and the personalised FedOTP
and FedPGP (`fedotp`, `fedpgp`, `personal`, `personal_data`, and `client_state`: where a client keeps
its personal tensors).

Flower (`pip install 'coop[federated]'`) is imported only by the modules that need it, so
`import coop` works without it. Entry point: `tools/federated.py`.

The federated layer: may import coop.train, coop.methods, coop.model, coop.data, coop.config and
the root modules. Imported by: coop.interop and the tools.
"""
