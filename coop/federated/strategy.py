"""The server's strategy: which clients train each round, and how their prompts are combined.

`PromptStrategy` is a Flower `Strategy` (Message API). Clients are identified by their
partition id (each node reports it once, `set_nodes`), never by Flower's random node ids, so that
sampling and aggregation are the same in every run and on resume:

- sampling: round r trains max(1, round(fl.fraction * fl.clients)) clients (Python's round:
  0.29 * 100 gives 29, where int() gives 28 through floating-point error; halves go to the even
  number) drawn by a `random.Random` seeded by (data.seed, r); all clients when fl.fraction = 1;
- aggregation (`aggregate`), over the replies sorted by partition id, in float64:
    shared tensors (PromptFL's prompt; G and the queries of latent domains)
        fedavg, fedprox   weighted mean, weights = the clients' num-examples
        uniform           plain mean (PromptFL's paper)
        last_client       the tensors of the last client (by partition id) that trained in the
                          round: what PromptFL's official code computes (its `average_weights`
                          averages N references to one model, the last client's)
    domain prompts D_k ("domain<k>.*" tensors; only clients that routed samples to D_k send it)
        D_k <- beta * D_k + (1 - beta) * mean of the received D_k,
        weighted by the samples each client routed to D_k (uniform: plain mean);
        D_k is unchanged in a round where no client used it;
- personal methods (FedOTP, FedPGP: `personal_keys`): round 1 trains every client, later rounds
  sample as above (the originals' rule). Messages carry only the global tensors: each client keeps
  its personal tensors itself (`coop.federated.client_state`), and the strategy records which
  version each client holds, `personal_round[k]` (the last round whose TRAIN reply from k was
  accepted; 0 = the initial value; kept in the checkpoint). Every TRAIN and EVALUATE message's
  config carries it as `personal-round`. After aggregation `configure_evaluate` sends EVALUATE
  to every client (sampled or not) and `aggregate_evaluate` averages their accuracies unweighted
  (`coop.federated.personal.client_means`, not Flower's example-weighted mean);
- failures: a client whose TRAIN reply is an error (or malformed) is left out of the round,
  keeps its previous `personal_round`, and is reported in `last_failures` with its partition id
  and reason; the caller decides whether the run goes on (`fl.on_client_failure`). If every
  sampled client fails, there is nothing to aggregate and the global tensors stay as they were.
  A failed EVALUATE reply is listed in `last_eval_failures` and the round has no personal
  metrics (`aggregate_evaluate` returns None).

FedProx's proximal term is the clients' business: the strategy only sends `proximal-mu`.
`bytes_down`/`bytes_up` in `last_stats` count the raw global tensors of every message of the round
(TRAIN, and for personal methods EVALUATE).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from coop.data.images import derive_seed
from coop.federated.latent_domains import domain_of_key
from coop.federated.personal import client_means

log = logging.getLogger(__name__)


def sample_clients(seed: int, rnd: int, clients: int, fraction: float) -> list[int]:
    """The partition ids that train in round `rnd`, sorted; a function of (seed, round) only."""
    m = max(1, round(fraction * clients))
    if m >= clients:
        return list(range(clients))
    return sorted(random.Random(derive_seed(seed, rnd)).sample(range(clients), m))


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Raw bytes of a set of tensors (the prompt payload, without message framing)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def aggregate(
    current: dict[str, torch.Tensor], replies: list[dict], aggregation: str, beta: float
) -> dict[str, torch.Tensor]:
    """New global tensors from the clients' replies (see the module docstring for the rules).

    Args:
        current: the global tensors the round started from.
        replies: one dict per successful client, sorted by partition id, with keys `tensors`
            (name -> tensor), `num_examples` and `usage` (samples routed to each domain prompt).
        aggregation: "fedavg", "uniform", "fedprox" or "last_client".
        beta: moving-average rate of the domain prompts.
    """
    out = {}
    for key, old in current.items():
        k = domain_of_key(key)
        senders = [r for r in replies if key in r["tensors"]]
        if not senders:
            out[key] = old.clone()
            continue
        if aggregation == "last_client":
            out[key] = senders[-1]["tensors"][key].to(old.dtype).clone()
            continue
        if aggregation == "uniform":
            weights = [1.0] * len(senders)
        elif k is None:
            weights = [float(r["num_examples"]) for r in senders]
        else:
            weights = [float(r["usage"][k]) for r in senders]
        total = sum(weights)
        mean = sum(w / total * r["tensors"][key].double() for w, r in zip(weights, senders, strict=True))
        if k is not None:
            mean = beta * old.double() + (1 - beta) * mean
        out[key] = mean.to(old.dtype)
    return out


def failure_reason(reply: Message) -> str:
    """The one-line reason of an error reply (a client's own, or the engine's last line)."""
    reason = (reply.error.reason or "").strip()
    if "Message: " in reason:  # the simulation engine wraps exceptions it caught itself
        reason = reason.rsplit("Message: ", 1)[1]
    lines = [line for line in reason.splitlines() if line.strip()]
    return (lines[-1] if lines else "unknown error").strip().rstrip("'>")


class PromptStrategy(Strategy):
    """Seeded client sampling and deterministic prompt aggregation (see the module docstring).

    Args:
        clients, fraction, seed: `fl.clients`, `fl.fraction`, `data.seed`.
        aggregation, mu, beta: `fl.aggregation`, `fl.mu`, `fl.beta`.
        personal_keys: the method's `personal_keys` (FedOTP, FedPGP): tensors that never travel.
    """

    def __init__(
        self,
        *,
        clients: int,
        fraction: float,
        seed: int,
        aggregation: str,
        mu: float,
        beta: float,
        personal_keys: Sequence[str] = (),
    ):
        self.clients, self.fraction, self.seed = clients, fraction, seed
        self.personal_keys = tuple(personal_keys)
        self.personal_round: dict[int, int] = {}  # partition id -> the version it holds (absent: 0)
        self.aggregation, self.mu, self.beta = aggregation, mu, beta
        self.nodes: dict[int, int] = {}  # partition id -> Flower node id
        self.current: dict[str, torch.Tensor] = {}
        self.last_failures: list[dict] = []
        self.last_eval_failures: list[dict] = []
        self.last_stats: dict = {}
        self.domain_usage: list[int] = []  # samples routed to each domain prompt, all rounds so far

    def state_dict(self) -> dict:
        """What a checkpoint keeps besides the global tensors (which hold the moving averages)."""
        return {"domain_usage": list(self.domain_usage), "personal_round": dict(self.personal_round)}

    def load_state_dict(self, state: dict) -> None:
        self.domain_usage = list(state.get("domain_usage", []))
        self.personal_round = {int(k): int(v) for k, v in state.get("personal_round", {}).items()}

    def client_config(self, config: ConfigRecord, pid: int) -> ConfigRecord:
        """`config` for client `pid`'s message: a personal method adds the `personal-round` it holds."""
        if not self.personal_keys:
            return config
        return ConfigRecord({**config, "personal-round": self.personal_round.get(pid, 0)})

    def set_nodes(self, nodes: dict[int, int]) -> None:
        self.nodes = dict(nodes)

    def summary(self) -> None:
        log.info(
            "strategy: %d clients, fraction %s, aggregation %s%s, domain-prompt beta %s",
            self.clients,
            self.fraction,
            self.aggregation,
            f" (mu {self.mu})" if self.aggregation == "fedprox" else "",
            self.beta,
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        first_all = bool(self.personal_keys) and server_round == 1
        pids = (
            list(range(self.clients))
            if first_all
            else sample_clients(self.seed, server_round, self.clients, self.fraction)
        )
        self.current = arrays.to_torch_state_dict()
        config["server-round"] = server_round
        config["proximal-mu"] = float(self.mu) if self.aggregation == "fedprox" else 0.0
        messages = [
            Message(
                RecordDict({"arrays": arrays, "config": self.client_config(config, p)}),
                message_type=MessageType.TRAIN,
                dst_node_id=self.nodes[p],
            )
            for p in pids
        ]
        self.last_stats = {"sampled": pids, "bytes_down": len(pids) * tensor_bytes(self.current)}
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        by_node = {node: pid for pid, node in self.nodes.items()}
        good, self.last_failures = [], []
        bytes_up = 0
        for reply in replies:
            pid = by_node.get(reply.metadata.src_node_id, -1)
            if reply.has_error():
                self.last_failures.append(
                    {"round": server_round, "client": pid, "error": failure_reason(reply)}
                )
                continue
            tensors = reply.content["arrays"].to_torch_state_dict()
            metrics = reply.content["metrics"]
            problem = self._check(tensors)
            if problem:
                self.last_failures.append({"round": server_round, "client": pid, "error": problem})
                continue
            n_domains = sum(1 for k in metrics.keys() if k.startswith("usage-"))
            usage = [int(metrics[f"usage-{k}"]) for k in range(n_domains)]
            bytes_up += tensor_bytes(tensors)
            good.append(
                {
                    "pid": pid,
                    "tensors": tensors,
                    "num_examples": int(metrics["num-examples"]),
                    "usage": usage,
                    "loss": float(metrics["train-loss"]),
                    "acc": float(metrics["train-acc"]),
                }
            )
        missing = (
            set(self.last_stats["sampled"])
            - {g["pid"] for g in good}
            - {f["client"] for f in self.last_failures}
        )
        for pid in sorted(missing):  # no reply at all (e.g. a node that went away)
            self.last_failures.append({"round": server_round, "client": pid, "error": "no reply"})
        self.last_failures.sort(key=lambda f: f["client"])
        good.sort(key=lambda g: g["pid"])
        self.last_stats.update(clients=len(good), bytes_up=bytes_up, replies=good)
        if not good:
            return None, None
        for g in good:
            if self.personal_keys:  # the client saved this round's personal tensors before replying
                self.personal_round[g["pid"]] = server_round
            if len(self.domain_usage) < len(g["usage"]):
                self.domain_usage += [0] * (len(g["usage"]) - len(self.domain_usage))
            for k, u in enumerate(g["usage"]):
                self.domain_usage[k] += u
        new = aggregate(self.current, good, self.aggregation, self.beta)
        n = sum(g["num_examples"] for g in good)
        metrics = MetricRecord(
            {
                "train-loss": sum(g["loss"] * g["num_examples"] for g in good) / n,
                "train-acc": sum(g["acc"] * g["num_examples"] for g in good) / n,
                "num-examples": n,
            }
        )
        return ArrayRecord(new), metrics

    def _check(self, tensors: dict[str, torch.Tensor]) -> str:
        for key, t in tensors.items():
            if key in self.personal_keys:
                return f"sent its personal tensor {key}, which stays on the client"
            if key not in self.current or self.current[key].shape != t.shape:
                return f"sent an unexpected tensor {key} {tuple(t.shape)}"
            if not torch.isfinite(t).all():
                return f"sent non-finite values in {key}"
        return ""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Personal methods: EVALUATE to every client with the new global tensors. Others: none
        (their evaluation is central, the server's evaluate_fn on the global test split)."""
        if not self.personal_keys:
            return []
        config["server-round"] = server_round
        self.last_stats["bytes_down"] += self.clients * tensor_bytes(arrays.to_torch_state_dict())
        return [
            Message(
                RecordDict({"arrays": arrays, "config": self.client_config(config, p)}),
                message_type=MessageType.EVALUATE,
                dst_node_id=self.nodes[p],
            )
            for p in range(self.clients)
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The personal fields of the round (`client_means` over ALL clients), or None when a client
        failed to evaluate (listed in `last_eval_failures`): Local is defined over every client."""
        by_node = {node: pid for pid, node in self.nodes.items()}
        got, self.last_eval_failures = {}, []
        for reply in replies:
            pid = by_node.get(reply.metadata.src_node_id, -1)
            if reply.has_error():
                self.last_eval_failures.append(
                    {"round": server_round, "client": pid, "error": failure_reason(reply)}
                )
            else:
                got[pid] = dict(reply.content["metrics"])
        failed = {f["client"] for f in self.last_eval_failures}
        for pid in sorted(set(range(self.clients)) - set(got) - failed):
            self.last_eval_failures.append({"round": server_round, "client": pid, "error": "no reply"})
        self.last_eval_failures.sort(key=lambda f: f["client"])
        if self.last_eval_failures:
            return None
        out = client_means([got[k] for k in range(self.clients)])
        return MetricRecord({k: v for k, v in out.items() if v is not None})
