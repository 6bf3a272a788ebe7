"""Client partitions of a training split, from Flower Datasets' partitioners.

    parts = partition(labels, domains, scheme="dirichlet", clients=10, seed=1, alpha=0.5)
    parts.clients[3]        # indices (into the training split) of client 3's items

The items become a Hugging Face `datasets.Dataset` with columns `index`, `label` and `domain`,
shuffled with `seed` (as `flwr_datasets.FederatedDataset` does before it partitions), then split
by a partitioner:

    iid           IidPartitioner: equal contiguous shards of the shuffled items
    dirichlet     DirichletPartitioner(partition_by="label", alpha, seed): class proportions per
                  client drawn from Dir(alpha); every client gets at least `min_size` items
    pathological  PathologicalPartitioner(partition_by="label", num_classes_per_partition,
                  class_assignment_mode="random", seed): each client sees only that many classes
    domain        NaturalIdPartitioner(partition_by="domain"): client k holds source domain k
                  (sorted names); needs as many clients as source domains

PromptFL's own data (`fl.partition=promptfl`: K shots per class for every client, drawn from the
full train split) is `coop.federated.promptfl_data`; it returns the same `Partition`.

Everything is a function of (items, scheme, clients, seed, alpha, classes_per_client), so every
process (server, simulated or real clients) computes the same partition. `Partition.to_json`
records the settings, a hash of the items and per-client label and domain counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SCHEMES = ("iid", "dirichlet", "pathological", "domain")
MAX_MIN_SIZE = 10  # DirichletPartitioner's own default minimum partition size


class PartitionError(ValueError):
    """The partition settings do not fit the data (one-line message naming the key)."""


@dataclass
class Partition:
    scheme: str
    seed: int
    settings: dict
    clients: list[list[int]]
    items_sha256: str
    labels: list[int] = field(repr=False)
    domains: list[str] | None = field(repr=False, default=None)

    def sizes(self) -> list[int]:
        return [len(c) for c in self.clients]

    def digest(self) -> str:
        """A short hash of the assignment, sent to clients so that they can check theirs."""
        return hashlib.sha256(json.dumps([self.items_sha256, self.clients]).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        def counts(values, idx):
            c = Counter(values[i] for i in idx)
            return {str(k): c[k] for k in sorted(c)}

        return {
            "scheme": self.scheme,
            "seed": self.seed,
            **self.settings,
            "n_items": len(self.labels),
            "items_sha256": self.items_sha256,
            "digest": self.digest(),
            "sizes": self.sizes(),
            "label_counts": [counts(self.labels, idx) for idx in self.clients],
            "domain_counts": None
            if self.domains is None
            else [counts(self.domains, idx) for idx in self.clients],
            "clients": self.clients,
        }


def items_digest(keys: list[str]) -> str:
    """SHA-256 of the training items (e.g. relative path and label per item), in order."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def _dataset(labels: list[int], domains: list[str] | None, seed: int):
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    columns = {"index": list(range(len(labels))), "label": list(labels)}
    if domains is not None:
        columns["domain"] = list(domains)
    return Dataset.from_dict(columns).shuffle(seed=seed)


def _partitioner(scheme: str, clients: int, seed: int, alpha: float, classes_per_client: int, n: int):
    from flwr_datasets import partitioner as fp

    if scheme == "iid":
        return fp.IidPartitioner(num_partitions=clients), {}
    if scheme == "dirichlet":
        min_size = max(1, min(MAX_MIN_SIZE, n // (2 * clients)))
        part = fp.DirichletPartitioner(
            num_partitions=clients,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=min_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
        return part, {"alpha": float(alpha), "min_size": min_size}
    if scheme == "pathological":
        part = fp.PathologicalPartitioner(
            num_partitions=clients,
            partition_by="label",
            num_classes_per_partition=int(classes_per_client),
            class_assignment_mode="random",
            shuffle=True,
            seed=seed,
        )
        return part, {"classes_per_client": int(classes_per_client)}
    return fp.NaturalIdPartitioner(partition_by="domain"), {}


def partition(
    labels: list[int],
    domains: list[str] | None,
    *,
    scheme: str,
    clients: int,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    item_keys: list[str] | None = None,
) -> Partition:
    """Split items (given by their labels, and domains if known) among `clients` clients.

    Args:
        labels: the label of each training item.
        domains: the domain of each item (multi-domain data), or None.
        scheme: one of `SCHEMES`.
        clients: number of clients.
        seed: the run's seed (shuffling and the partitioners' own randomness).
        alpha: Dirichlet concentration (`fl.alpha`).
        classes_per_client: classes per client for `pathological` (`fl.classes_per_client`).
        item_keys: one string per item (path and label) for the recorded items hash.

    Raises:
        PartitionError: settings that cannot give every client data.
    """
    n = len(labels)
    if scheme not in SCHEMES:
        raise PartitionError(f"fl.partition={scheme!r} is not one of {', '.join(SCHEMES)}")
    if clients < 1:
        raise PartitionError(f"fl.clients must be >= 1, got {clients}")
    if n < clients:
        raise PartitionError(f"fl.clients={clients} is more than the {n} training images")
    if scheme == "domain":
        if domains is None:
            raise PartitionError("fl.partition=domain needs data with domains (data.name=multidomain)")
        names = sorted(set(domains))
        if len(names) != clients:
            raise PartitionError(
                f"fl.partition=domain gives each client one source domain: set fl.clients={len(names)} "
                f"(domains: {', '.join(names)})"
            )
    if scheme == "dirichlet" and not float(alpha) > 0:
        raise PartitionError(f"fl.alpha must be > 0, got {alpha}")
    n_classes = len(set(labels))
    if scheme == "pathological" and not 1 <= int(classes_per_client) <= n_classes:
        raise PartitionError(f"fl.classes_per_client must be in 1..{n_classes}, got {classes_per_client}")

    dataset = _dataset(labels, domains, seed)
    part, settings = _partitioner(scheme, clients, seed, alpha, classes_per_client, n)
    part.dataset = dataset
    if scheme == "domain":
        # NaturalIdPartitioner numbers domains in order of appearance; clients take sorted names
        by_name = {}
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            shards = [part.load_partition(pid) for pid in range(part.num_partitions)]
        for shard in shards:
            by_name[shard[0]["domain"]] = sorted(shard["index"])
        assigned = [by_name[name] for name in sorted(by_name)]
        settings = {"client_domains": sorted(by_name)}
    else:
        try:
            with warnings.catch_warnings():  # Dirichlet redraws until every client has min_size items
                warnings.filterwarnings("ignore", message="The specified min_partition_size")
                assigned = [sorted(part.load_partition(pid)["index"]) for pid in range(clients)]
        except ValueError as e:  # e.g. Dirichlet cannot reach the minimum size
            raise PartitionError(f"fl.partition={scheme}: {str(e).splitlines()[0]}") from None
    empty = [k for k, idx in enumerate(assigned) if not idx]
    if empty:
        raise PartitionError(
            f"fl.partition={scheme} leaves client {empty[0]} without data ({n} images, {clients} clients)"
        )
    used = sum(len(idx) for idx in assigned)
    if used < n:
        log.warning("fl.partition=%s assigns %d of %d training images to no client", scheme, n - used, n)
    keys = item_keys if item_keys is not None else [str(y) for y in labels]
    return Partition(scheme, seed, settings, assigned, items_digest(keys), list(labels), domains)
