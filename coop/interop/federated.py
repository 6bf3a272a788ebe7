"""A federated run's models for export and prediction: its global model, or client k's own.

    fl_method = federated_method(ckpt)                          # "fedotp", or None for other runs
    tensors, model = run_model(folder, ckpt, client=3)          # model: "global" or "client 3"
    method = build_federated(clip, classnames, cfg, fl_method, model, tensors)

The checkpoint of a federated run (`coop.federated.server`) holds the global tensors only, under
the names of its `fl.method`'s model (`coop.federated.task.FL_METHODS`): PromptFL's are CoOp's
`ctx`, FedOTP's `global.ctx`, FedPGP's `sigma`, the latent-domain prompts' `global.*`, `domain<k>.*`
and `query`. FedOTP and FedPGP keep each client's own part (`local.ctx`; `U`, `V`) with the client,
in `<run>/clients/client<k>/personal_round<r>.pt` (the one-machine simulation), r being the round the
checkpoint names for that client (`strategy.personal_round`; 0: never trained, the initial value).

- The **global model** is what the run's `accuracy` scores: for FedOTP and FedPGP the global part
  alone (`global_only`); the personal tensors it does not use keep their initial value.
- **Client k's model** (`client=k`, FedOTP and FedPGP only) is the global part with client k's own.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from coop.interop.dassl import InteropError
from coop.methods import Method
from coop.train.checkpoint import FEDERATED_FORMAT


class FederatedModelError(InteropError):
    """A federated run's model cannot be chosen (a client without one, a missing state file)."""


def federated_method(ckpt: dict) -> str | None:
    """The `fl.method` of a federated run's checkpoint; None for any other run."""
    if ckpt.get("format") != FEDERATED_FORMAT:
        return None
    return str(ckpt["config"].get("fl", {}).get("method", "promptfl"))


def personal_keys(fl_method: str | None) -> tuple[str, ...]:
    """The tensors a client keeps (FedOTP, FedPGP); () for the others and for non-federated runs."""
    if fl_method is None:
        return ()
    from coop.federated.task import FL_METHODS

    return tuple(getattr(FL_METHODS[fl_method], "personal_keys", ()))


def run_model(
    folder: str | os.PathLike, ckpt: dict, client: int | None = None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """(tensors, model) of a run: a federated run's global model or client `client`'s (module doc);
    any other run's learned tensors, with model None.

    Raises:
        FederatedModelError: `client` for a run that has no per-client models, out of range, or
            client state that cannot be read.
    """
    folder = Path(folder)
    fl = federated_method(ckpt)
    if client is None:
        return dict(ckpt["prompt"]), None if fl is None else "global"
    if fl is None:
        raise FederatedModelError(f"{folder} is not a federated run: a client's model exists only there")
    keys = personal_keys(fl)
    if not keys:
        raise FederatedModelError(
            f"{folder} is a fl.method={fl} run: its clients share the global model, which is exported "
            "without a client"
        )
    clients = int(ckpt["config"]["fl"]["clients"])
    if not 0 <= client < clients:
        raise FederatedModelError(
            f"{folder} has clients 0..{clients - 1} (fl.clients={clients}), not {client}"
        )
    rnd = int(ckpt.get("strategy", {}).get("personal_round", {}).get(client, 0))
    if rnd == 0:  # never trained: its part is the initial value (built from data.seed)
        return dict(ckpt["prompt"]), f"client {client}"
    from coop.federated.client_state import PersonalStateError, client_dir, read_round_file, round_file

    path = round_file(client_dir(folder, client), rnd)
    if not path.is_file():
        raise FederatedModelError(
            f"client {client}'s tensors of round {rnd} are not at {path} (a deployment keeps them in "
            "each SuperNode's state-dir: copy that file there)"
        )
    try:
        tensors = read_round_file(path, client, rnd, keys)
    except PersonalStateError as e:
        raise FederatedModelError(str(e)) from None
    return {**ckpt["prompt"], **tensors}, f"client {client}"


def build_federated(
    clip, classnames: list[str], cfg: DictConfig, fl_method: str, model: str, tensors: dict
) -> tuple[Method, dict[str, torch.Tensor]]:
    """The `fl_method`'s model for `classnames` and the full set of tensors to load into it: the
    personal tensors a global model leaves out keep the initial value (module docstring)."""
    from coop.federated.task import build_method

    method = build_method(clip, classnames, cfg)  # seeded by data.seed, as the server builds it
    keys = personal_keys(fl_method)
    if keys and model == "global":
        method.global_only = True
    initial = {k: v.detach().clone() for k, v in method.learnable().items() if k in keys}
    return method, {**initial, **tensors}
