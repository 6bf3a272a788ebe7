"""PromptFL's client data (`fl.partition=promptfl`): K shots per class for every client.

    part = promptfl_partition(ds.train, ds.val, shots=1, clients=64, iid=False, repeat_rate=0.0, seed=1)

This is the official code's rule (PromptFL's `DatasetBase.generate_federated_fewshot_dataset`, run
on the full train split), drawn from one `random.Random(data.seed)` stream consumed in the order of
the official pipeline:

1. `federated_main.py` seeds Python's `random` and builds its trainer twice, a global one (which
   only evaluates) and a local one (which trains every client). Each build reads the dataset, and
   each read draws, in this order:
   a. CoOp's K-shot train subset and its min(K, 4)-shot val subset (`coop.data.fewshot`'s rule;
      PromptFL's readers draw them and keep them, unused by the clients);
   b. the federated draw below, on the full train split.
2. The clients train on the second build's federated draw, so that is the partition.

The federated draw, with C = the number of classes (largest label + 1) and N = `fl.clients`:

- the class list 0..C-1 is shuffled once;
- `repeat_rate` = 0: with `iid`, every client holds every class; otherwise client i holds the
  shuffled classes [i c, (i + 1) c), c = round(C / N) (Python's round), and the last client all
  classes from (N - 1) c on;
- `repeat_rate` > 0: the first int(repeat_rate C) shuffled classes are "repeated". With
  fold = int(N / K) > 0 the client ids are shuffled and cut into `fold` groups of round(N / fold),
  and group k shares the repeated classes [k r, (k + 1) r), r = round(repeated / fold) (the last
  group the rest; a client in no group none); with fold = 0 every client shares all of them. The
  other classes are dealt out as for repeat_rate 0, c = round((C - repeated) / N). A repeated class
  gives max(1, int(K / N)) images, another class K;
- per client, then per label in order of first appearance in the train split, `random.sample`
  draws the images; with repeat_rate 0 a class with fewer than K images gives all of them.

A client's items are listed in draw order; different clients may hold the same image. Settings
that leave a client without images are refused (the official code fails on them: its data loader
asserts a non-empty client).
"""

from __future__ import annotations

import random
from collections import defaultdict

from coop.data.base import Datum
from coop.data.fewshot import VAL_SHOTS_MAX, sample_per_class
from coop.federated.partition import Partition, PartitionError, items_digest

OFFICIAL_BUILDS = 2  # federated_main.py builds a global and a local trainer, each reading the data


def _by_label(labels: list[int]) -> dict[int, list[int]]:
    """Item indices per label, labels in order of first appearance (Dassl's split_dataset_by_label)."""
    out: dict[int, list[int]] = defaultdict(list)
    for i, y in enumerate(labels):
        out[y].append(i)
    return out


def client_classes(
    n_classes: int, clients: int, shots: int, iid: bool, repeat_rate: float, rng: random.Random
) -> tuple[list[list[int]], list[int]]:
    """(classes of each client, the repeated classes): the class half of the federated draw."""
    class_list = list(range(n_classes))
    rng.shuffle(class_list)
    repeated, rest, folds = [], class_list, []
    per_client = int(round(n_classes / clients))
    if repeat_rate > 0:
        n_rep = int(repeat_rate * n_classes)
        repeated, rest = class_list[:n_rep], class_list[n_rep:]
        per_client = int(round((n_classes - n_rep) / clients))
        fold = int(clients / shots)
        if fold > 0:
            per_fold, rep_per_fold = int(round(clients / fold)), int(round(n_rep / fold))
            ids = list(range(clients))
            rng.shuffle(ids)
            folds = [ids[i * per_fold : min((i + 1) * per_fold, clients)] for i in range(fold)]
    out = []
    for idx in range(clients):
        if iid:
            out.append(list(range(n_classes)))
            continue
        own = []
        if repeat_rate > 0:
            if folds:
                for k, members in enumerate(folds):
                    if idx in members:
                        end = len(repeated) if k == len(folds) - 1 else (k + 1) * rep_per_fold
                        own += repeated[k * rep_per_fold : end]
            else:
                own += repeated
        end = len(rest) if idx == clients - 1 else (idx + 1) * per_client
        out.append(own + rest[idx * per_client : end])
    return out, repeated


def federated_fewshot(
    labels: list[int], *, shots: int, clients: int, iid: bool, repeat_rate: float, rng: random.Random
) -> tuple[list[list[int]], list[list[int]]]:
    """PromptFL's federated draw on items with `labels`: (item indices per client, classes per client)."""
    tracker = _by_label(labels)
    classes, repeated = client_classes(max(labels) + 1, clients, shots, iid, repeat_rate, rng)
    repeated = set(repeated)
    out = []
    for own in classes:
        own_set, items = set(own), []
        for label, group in tracker.items():
            if label not in own_set:
                continue
            if repeat_rate == 0:
                items += rng.sample(group, shots) if len(group) >= shots else group
                continue
            k = max(1, int(shots / clients)) if label in repeated else shots
            if len(group) < k:
                raise PartitionError(
                    f"fl.repeat_rate={repeat_rate}: class {label} has {len(group)} training images, fewer "
                    f"than the {k} drawn per client (the official code fails here too)"
                )
            items += rng.sample(group, k)
        out.append(items)
    return out, classes


def promptfl_partition(
    train: list[Datum],
    val: list[Datum],
    *,
    shots: int,
    clients: int,
    iid: bool,
    repeat_rate: float,
    seed: int,
    item_keys: list[str] | None = None,
) -> Partition:
    """The clients' items (indices into `train`) as PromptFL's pipeline draws them (module docstring).

    Args:
        train, val: the full train and val splits, in split-file order.
        shots: K, images per class per client (`data.shots`).
        clients: `fl.clients`.
        iid, repeat_rate: `fl.iid`, `fl.repeat_rate`.
        seed: `data.seed`, the seed of the one stream.
        item_keys: one string per train item (path and label) for the recorded items hash.

    Raises:
        PartitionError: settings that leave a client without images, or too few images to draw.
    """
    if shots < 1:
        raise PartitionError(
            "fl.partition=promptfl draws data.shots images per class per client: set data.shots >= 1"
        )
    if clients < 1:
        raise PartitionError(f"fl.clients must be >= 1, got {clients}")
    if not train:
        raise PartitionError(
            "fl.partition=promptfl draws the clients' images from the train split, which is empty"
        )
    labels = [d.label for d in train]
    rng = random.Random(seed)  # the stream random.seed(seed) gives federated_main.py
    for _ in range(OFFICIAL_BUILDS):
        # CoOp's subsets, drawn only to advance the stream as the official readers do (no class
        # names: no warnings about small classes, which the clients' draw does not use)
        sample_per_class(train, shots, rng, [], "train")
        if val:
            sample_per_class(val, min(shots, VAL_SHOTS_MAX), rng, [], "val")
        assigned, classes = federated_fewshot(
            labels, shots=shots, clients=clients, iid=iid, repeat_rate=repeat_rate, rng=rng
        )
    empty = [k for k, idx in enumerate(assigned) if not idx]
    if empty:
        raise PartitionError(
            f"fl.partition=promptfl leaves client {empty[0]} without images ({max(labels) + 1} classes, "
            f"round(C / fl.clients) = {int(round((max(labels) + 1) / clients))} per client, {clients} "
            "clients); use fewer fl.clients or fl.iid=true"
        )
    settings = {
        "shots": shots,
        "iid": bool(iid),
        "repeat_rate": float(repeat_rate),
        "client_classes": classes,
    }
    keys = item_keys if item_keys is not None else [str(y) for y in labels]
    return Partition("promptfl", seed, settings, assigned, items_digest(keys), labels, None)
