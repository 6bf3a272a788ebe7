"""The client side: local training on cached image features, and the ClientApp's handlers.

Each TRAIN message carries the global tensors, the run's config (YAML), the round's lr and, for
FedOTP and FedPGP, the `personal-round` whose personal tensors this client must start from; the
client

1. builds (once per process, then from memory) CLIP, the dataset, the partition and the image
   features of its own partition (`partition-id` from its node config), and checks that its
   partition's digest equals the server's;
2. loads the global tensors (and its personal tensors of `personal-round` from its own state,
   `coop.federated.client_state`: Context.state, else its file) and trains `fl.local_epochs` epochs
   with a fresh SGD optimizer (train.momentum, train.weight_decay) at the run's `train.precision`
   (`task.run_precision`: amp = bf16 autocast with fp32 prompts, fp16 = CoOp's half-precision CLIP
   and prompts); batches are drawn from a generator seeded by (data.seed, round, client), so a
   round replays exactly; with fl.aggregation=fedprox the loss gets (fl.mu / 2) * ||w - w_global||^2;
3. saves its new personal tensors as this round's version (file, then Context.state) and deletes
   its files older than the version it loaded;
4. replies with the global tensors it trained (for latent domains: only the domain prompts it
   used; never personal ones) and its metrics: num-examples, train-loss, train-acc, partition-id,
   usage-<k>.

An EVALUATE message (personal methods, every client every round) carries the new global tensors
and `personal-round`; the client evaluates its personal model on its own test set (and the base
and novel test splits in base-to-novel runs) and replies with `coop.federated.personal`'s
`client_accuracies`. Apart from its personal tensors a client keeps nothing between rounds.

An exception is answered with an error reply that names the client ("client 2: DataError: ...");
the server decides what to do with it (`fl.on_client_failure`; a failed evaluation stops the run).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from coop.data import DataError
from coop.federated import personal
from coop.federated.client_state import PersonalStore, run_digest, state_dir
from coop.federated.latent_domains import domain_of_key
from coop.federated.task import (
    build_method,
    client_partition,
    features,
    is_personal,
    load_data,
    local_seed,
    prepare_precision,
    resolve_device,
    run_precision,
)
from coop.methods import Method
from coop.model.clip import CLIP
from coop.model.weights import load_clip
from coop.train.engine import NonFiniteLossError
from coop.train.precision import autocast

log = logging.getLogger(__name__)


def local_train(
    method: Method,
    feats: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    seed: int,
    mu: float = 0.0,
    anchor: dict[str, torch.Tensor] | None = None,
    precision: str = "fp32",
) -> dict:
    """Train `method.learnable()` in place on features ((V, N, E), labels (N,)); returns stats.

    Each epoch draws a permutation of the N items and one view per item from one generator
    seeded by `seed`; batches of `batch_size` (the last, incomplete one is dropped unless it is
    the only one, as in CoOp's few-shot loaders).

    Args:
        method: a method whose `loss(image_features, labels)` gives (loss, logits).
        epochs, batch_size, lr, momentum, weight_decay: the local SGD.
        seed: seeds the batch order (`local_seed(data.seed, round, client)`).
        mu: FedProx's proximal weight; adds (mu / 2) * sum ||w - anchor||^2 to the loss.
        anchor: the global tensors the round started from (needed when mu > 0).
        precision: the run's precision (`task.run_precision`): amp trains under bf16 autocast
            (fp32 prompts); fp16 expects a method and features already in half precision.
    """
    learnable = method.learnable()
    device = next(iter(learnable.values())).device
    dtype = method.clip.logit_scale.dtype  # half under fp16
    optimizer = torch.optim.SGD(learnable.values(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    anchor = {k: anchor[k].to(device) for k in learnable} if mu > 0 else None
    n_views, n = feats.shape[:2]
    n_batches = n // batch_size if n >= batch_size else 1
    method.train()
    total, correct, seen = 0.0, 0, 0
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen)
        view = torch.randint(n_views, (n,), generator=gen)
        for b in range(n_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            x, y = feats[view[idx], idx].to(device, dtype), labels[idx].to(device)
            with autocast(device, precision):
                loss, logits = method.loss(x, y)
            objective = loss
            if anchor is not None:
                objective = loss + mu / 2 * sum(((p - anchor[k]) ** 2).sum() for k, p in learnable.items())
            if not torch.isfinite(objective):
                raise NonFiniteLossError(
                    f"non-finite loss ({objective.item()}) in epoch {epoch + 1}, step {b + 1}"
                )
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
            total += loss.item() * len(y)
            correct += int((logits.argmax(-1) == y).sum())
            seen += len(y)
    return {"loss": total / seen, "train_acc": 100.0 * correct / seen, "num_examples": n}


@dataclass
class ClientData:
    clip: CLIP
    classnames: list[str]
    feats: torch.Tensor  # (V, N, E)
    labels: torch.Tensor  # (N,)
    digest: str
    method: Method
    precision: str  # what runs: `task.run_precision`
    initial: dict[str, torch.Tensor]  # the personal tensors as built: every client's (and the server's) start


_CACHE: dict[tuple, ClientData] = {}  # per process: (config, partition id) -> data; a pure cache


def client_data(cfg: DictConfig, pid: int) -> ClientData:
    """CLIP, features of partition `pid` and the method, built once per (config, pid) and process."""
    key = (OmegaConf.to_yaml(cfg), pid)
    if key not in _CACHE:
        if len(_CACHE) >= 32:
            _CACHE.clear()
        device = resolve_device(cfg.device)
        clip = load_clip(cfg.model.name, cfg.model.pretrained, device, cfg.model.tokenizer)
        ds = load_data(cfg)
        part = client_partition(cfg, ds)
        if not 0 <= pid < len(part.clients):
            raise DataError(f"partition-id {pid} is not in 0..{len(part.clients) - 1} (fl.clients)")
        items = [ds.train[i] for i in part.clients[pid]]
        method = build_method(clip, ds.classnames, cfg).to(device)
        precision = run_precision(cfg, device)
        prepare_precision(clip, method, precision)  # before the features: fp16 encodes in half
        feats, labels = features(
            cfg,
            clip,
            items,
            device,
            train=True,
            what=f"client {pid}'s training images",
            tokens=method.image_tokens,
        )
        keys = getattr(method, "personal_keys", ())
        initial = {k: method.learnable()[k].detach().cpu().clone() for k in keys}
        _CACHE[key] = ClientData(
            clip, list(ds.classnames), feats, labels, part.digest(), method, precision, initial
        )
    return _CACHE[key]


_EVAL: dict[str, personal.EvalData] = {}  # per process: config -> test features; shared by its clients


def eval_data(cfg: DictConfig, data: ClientData) -> personal.EvalData:
    """The run's test sets (`personal.eval_data`), built once per config and process."""
    key = OmegaConf.to_yaml(cfg)
    if key not in _EVAL:
        if len(_EVAL) >= 4:
            _EVAL.clear()
        _EVAL[key] = personal.eval_data(
            cfg, data.clip, data.method, resolve_device(cfg.device), data.precision
        )
    return _EVAL[key]


def client_config(text: str, node_config: dict) -> DictConfig:
    """The server's run config, with this node's `data-root` and `device` (if given) on top."""
    cfg = OmegaConf.create(text)
    if "data-root" in node_config:
        cfg.data.root = str(node_config["data-root"])
    if "device" in node_config:
        cfg.device = str(node_config["device"])
    return cfg


def checked_data(cfg: DictConfig, pid: int, digest: str) -> ClientData:
    """`client_data`, refused if its partition's digest is not the server's."""
    data = client_data(cfg, pid)
    if data.digest != digest:
        raise DataError(
            f"its partition (digest {data.digest}) differs from the server's ({digest}): "
            "the clients must see the same dataset, fl.* settings and data.seed as the server"
        )
    return data


def train_round(
    cfg: DictConfig,
    pid: int,
    tensors: dict,
    rnd: int,
    lr: float,
    mu: float,
    digest: str,
    own: dict | None = None,
):
    """One client's round: (global tensors to send back, its personal tensors, metrics).

    Args:
        tensors: the global tensors of the round.
        own: a personal method's personal tensors to start from (`PersonalStore.load`).
    """
    data = checked_data(cfg, pid, digest)
    method = data.method
    method.load_learnable({**tensors, **(own or {})}, data.classnames)
    if hasattr(method, "reset_usage"):
        method.reset_usage()
    stats = local_train(
        method,
        data.feats,
        data.labels,
        epochs=int(cfg.fl.local_epochs),
        batch_size=int(cfg.train.batch_size),
        lr=lr,
        momentum=float(cfg.train.momentum),
        weight_decay=float(cfg.train.weight_decay),
        seed=local_seed(int(cfg.data.seed), rnd, pid),
        mu=mu,
        anchor=tensors,
        precision=data.precision,
    )
    usage = [int(u) for u in getattr(method, "usage", torch.zeros(0)).tolist()]
    trained = {k: v.detach().cpu().clone() for k, v in method.learnable().items()}
    mine = {k: trained.pop(k) for k in getattr(method, "personal_keys", ())}
    sent = {k: v for k, v in trained.items() if domain_of_key(k) is None or usage[domain_of_key(k)] > 0}
    metrics = {
        "num-examples": stats["num_examples"],
        "train-loss": stats["loss"],
        "train-acc": stats["train_acc"],
        "partition-id": pid,
        **{f"usage-{k}": u for k, u in enumerate(usage)},
    }
    return sent, mine, metrics


# ---------------------------------------------------------------- Flower handlers


def handle_query(msg, context):
    """Tell the server which partition this node holds."""
    from flwr.app import Message, MetricRecord, RecordDict

    node = context.node_config
    record = MetricRecord(
        {"partition-id": int(node["partition-id"]), "num-partitions": int(node.get("num-partitions", -1))}
    )
    return Message(RecordDict({"metrics": record}), reply_to=msg)


def store_of(cfg: DictConfig, config, context, pid: int) -> PersonalStore:
    """This client's personal-tensor store (`coop.federated.client_state`)."""
    folder = state_dir(cfg, context.node_config, pid)
    return PersonalStore(context.state, folder, pid, run_digest(str(config["coop-config"])))


def train_message(msg, context, pid: int) -> dict:
    """A TRAIN message's work: load the personal version named, train, save this round's."""
    config = msg.content["config"]
    cfg = client_config(str(config["coop-config"]), context.node_config)
    rnd, digest = int(config["server-round"]), str(config["partition-digest"])
    store = store_of(cfg, config, context, pid) if is_personal(cfg) else None
    loaded = int(config.get("personal-round", 0))
    own = store.load(loaded, checked_data(cfg, pid, digest).initial) if store else None
    tensors = msg.content["arrays"].to_torch_state_dict()
    lr, mu = float(config["lr"]), float(config["proximal-mu"])
    sent, mine, metrics = train_round(cfg, pid, tensors, rnd, lr, mu, digest, own)
    if store is not None:
        store.save(rnd, mine)  # before the reply: the server may record this round once it has it
        store.prune(loaded)
    return {"arrays": sent, "metrics": metrics}


def evaluate_message(msg, context, pid: int) -> dict:
    """An EVALUATE message's work: this client's personal model on its test sets."""
    config = msg.content["config"]
    cfg = client_config(str(config["coop-config"]), context.node_config)
    data = checked_data(cfg, pid, str(config["partition-digest"]))
    own = store_of(cfg, config, context, pid).load(int(config["personal-round"]), data.initial)
    tensors = {**msg.content["arrays"].to_torch_state_dict(), **own}
    device = resolve_device(cfg.device)
    acc = personal.client_accuracies(
        eval_data(cfg, data), pid, data.method, tensors, data.classnames, device, data.precision
    )
    return {"metrics": {**acc, "partition-id": pid}}


def _reply(msg, context, work):
    """Run `work`; its records as the reply, or an error reply naming the client."""
    from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
    from flwr.common.constant import ErrorCode

    pid = int(context.node_config["partition-id"])
    try:
        out = work(msg, context, pid)
    except Exception as e:  # reported to the server with the client's id, never swallowed
        log.error("client %d failed:\n%s", pid, traceback.format_exc())
        reason = f"client {pid}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
    records = {"metrics": MetricRecord(out["metrics"])}
    if "arrays" in out:
        records["arrays"] = ArrayRecord(out["arrays"])
    return Message(RecordDict(records), reply_to=msg)


def handle_train(msg, context):
    """Train on this node's partition; errors become an error reply naming the client."""
    return _reply(msg, context, train_message)


def handle_evaluate(msg, context):
    """Evaluate this node's personal model (FedOTP, FedPGP); errors become an error reply."""
    return _reply(msg, context, evaluate_message)
