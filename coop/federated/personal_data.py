"""FedOTP's and FedPGP's client data (`fl.partition=pathological_fedotp`, `dirichlet_labeldir`) and
the clients' test sets.

    part = fedotp_partition(train_labels, test_labels, shots=2, clients=10)
    part.clients[3]                     # indices into the train split: client 3's K-shot items
    part.settings["client_test"][3]     # indices into the test split: client 3's test images

This is the rule of `DatasetBase.generate_federated_fewshot_dataset` in the FedOTP and FedPGP
repositories (the same function in both; non-IID, repeat rate 0), run on the full train split
(but see FedPGP's base-to-novel below), with its **fixed internal seed**: the function calls
`random.seed(2023)` itself, so the partition is the same for every run seed (`data.seed` still
seeds the prompts and the batches). With C classes (largest label + 1) and N = `fl.clients`:

- the class list 0..C-1 is shuffled (the first draw after `random.seed(2023)`);
- client i holds the shuffled classes [i c, (i + 1) c), c = round(C / N) (Python's round), and the
  last client every class from (N - 1) c on;
- per client in order, then per label in order of first appearance in the train split (Dassl's
  `split_dataset_by_label`), `random.sample(items, K)` draws K = `data.shots` images (a class with
  fewer than K images gives all of them), from the same stream.

A client's test set is every test image of its classes (the originals' `generate_federated_dataset`
on the test split, which reseeds 2023 and deals the same classes); its classifier still spans all
C classes. PromptFL's copy of the function lacks the fixed seed: `fl.partition=promptfl`
(`coop.federated.promptfl_data`) is that one, drawn from `data.seed`.

**FedPGP's base-to-novel** (`data.subsample_classes=base`) draws per dataset, as FedPGP's readers
do: on DTD, Caltech101, Food101 and Oxford Flowers (`fewshot_first`) the rule above runs on CoOp's
seeded K-shot subset of the train split (`coop.data.fewshot`, `data.seed`: Dassl's
`generate_fewshot_dataset` after `random.seed(SEED)`), restricted to the base classes, so each
client holds exactly the subset's images of its classes; on every other dataset (Oxford Pets, the
one its script runs, among them) on the full base split. On those four the partition depends on
`data.seed` through the subset.

`fl.partition=dirichlet_labeldir` is the originals' CIFAR split (`labeldir_partition`): Dirichlet
label skew with the test split cut by the same per-class proportions.
"""

from __future__ import annotations

import random

from coop.federated.partition import Partition, PartitionError, items_digest
from coop.federated.promptfl_data import _by_label

FEDOTP_SEED = 2023  # generate_federated_fewshot_dataset's own random.seed(2023)
# FedPGP's readers that deal base-to-novel clients from the seeded K-shot subset (`fewshot_first`)
FEDPGP_FEWSHOT_FIRST = ("dtd", "caltech101", "food101", "oxford_flowers")


def fewshot_first(partition: str, dataset: str, subsample_classes: str) -> bool:
    """Whether the clients are drawn from CoOp's seeded K-shot subset rather than the full train split:
    `pathological_fedotp` on a subset of the classes (FedPGP's base-to-novel) of a dataset whose
    FedPGP reader samples that subset first (module docstring).

    Args:
        partition: `fl.partition`.
        dataset: `data.name`.
        subsample_classes: `data.subsample_classes`.
    """
    return (
        partition == "pathological_fedotp" and subsample_classes != "all" and dataset in FEDPGP_FEWSHOT_FIRST
    )


def fedotp_classes(n_classes: int, clients: int, rng: random.Random) -> list[list[int]]:
    """The shuffled classes dealt out as the originals do (the last client takes the remainder)."""
    class_list = list(range(n_classes))
    rng.shuffle(class_list)
    per_client = int(round(n_classes / clients))
    return [
        class_list[i * per_client : (n_classes if i == clients - 1 else (i + 1) * per_client)]
        for i in range(clients)
    ]


def fedotp_partition(
    train_labels: list[int],
    test_labels: list[int],
    *,
    shots: int,
    clients: int,
    item_keys: list[str] | None = None,
) -> Partition:
    """The clients' K-shot items and test sets as FedOTP/FedPGP draw them (module docstring).

    Args:
        train_labels: labels of the full train split, in split-file order.
        test_labels: labels of the test split (each client's test set: its classes' images).
        shots: K, images per class per client (`data.shots`).
        clients: N, `fl.clients`.
        item_keys: one string per train item (path and label) for the recorded items hash.

    Raises:
        PartitionError: settings that leave a client without classes or images.
    """
    if shots < 1:
        raise PartitionError(
            "fl.partition=pathological_fedotp draws data.shots per class: set data.shots >= 1"
        )
    if clients < 1 or not train_labels:
        raise PartitionError("fl.partition=pathological_fedotp needs fl.clients >= 1 and training images")
    n_classes = max(train_labels) + 1
    rng = random.Random(FEDOTP_SEED)
    classes = fedotp_classes(n_classes, clients, rng)
    tracker = _by_label(train_labels)
    assigned = []
    for own in classes:
        own_set, items = set(own), []
        for label, group in tracker.items():
            if label in own_set:
                items += rng.sample(group, shots) if len(group) >= shots else group
        assigned.append(items)
    empty = [k for k, idx in enumerate(assigned) if not idx]
    if empty:
        raise PartitionError(
            f"fl.partition=pathological_fedotp leaves client {empty[0]} without images ({n_classes} classes, "
            f"round(C / fl.clients) = {int(round(n_classes / clients))} per client); use fewer fl.clients"
        )
    settings = {
        "shots": shots,
        "partition_seed": FEDOTP_SEED,
        "client_classes": classes,
        "client_test": [[i for i, y in enumerate(test_labels) if y in set(own)] for own in classes],
    }
    keys = item_keys if item_keys is not None else [str(y) for y in train_labels]
    return Partition(
        "pathological_fedotp", FEDOTP_SEED, settings, assigned, items_digest(keys), list(train_labels)
    )


LABELDIR_MIN_SIZE = 10  # the originals' min_require_size: every client >= 10 train and test images
LABELDIR_MAX_DRAWS = 1000  # ours: give up (PartitionError) instead of looping for ever


def labeldir_partition(
    train_labels: list[int],
    test_labels: list[int],
    *,
    beta: float,
    clients: int,
    seed: int,
    item_keys: list[str] | None = None,
) -> Partition:
    """The originals' `noniid-labeldir` (`partition_data` in FedOTP's utils/datasplit.py): label skew
    by Dir(beta), the test split cut by the **same** per-class proportions.

    From numpy's stream seeded with `seed` (Dassl's `set_random_seed(cfg.SEED)`; the partition is
    its first draw), repeat until every client has >= 10 train and >= 10 test images: for each class
    k = 0..C-1, shuffle its train and test indices, draw p ~ Dir(beta, ..., beta) over the clients,
    zero the share of clients that already hold >= N_train / N_clients train images, renormalise,
    and cut both index lists at floor(cumsum(p) * n_k). Finally each client's train and test lists
    are shuffled. C = largest train label + 1.

    Args:
        train_labels, test_labels: labels of the train and test splits.
        beta: the Dirichlet concentration (`fl.alpha`).
        clients: `fl.clients`.
        seed: `data.seed`.
        item_keys: one string per train item for the recorded items hash.
    """
    import numpy as np

    y_train, y_test = np.asarray(train_labels), np.asarray(test_labels)
    n_classes, n_train = int(y_train.max()) + 1, len(y_train)
    rng = np.random.RandomState(seed)  # the global np.random after np.random.seed(seed)
    for _ in range(LABELDIR_MAX_DRAWS):
        train_parts, test_parts = [[] for _ in range(clients)], [[] for _ in range(clients)]
        for k in range(n_classes):
            train_k, test_k = np.where(y_train == k)[0], np.where(y_test == k)[0]
            rng.shuffle(train_k)
            rng.shuffle(test_k)
            p = rng.dirichlet(np.repeat(beta, clients))
            p = np.array(
                [q * (len(part) < n_train / clients) for q, part in zip(p, train_parts, strict=True)]
            )
            p = p / p.sum()
            cuts_train = (np.cumsum(p) * len(train_k)).astype(int)[:-1]
            cuts_test = (np.cumsum(p) * len(test_k)).astype(int)[:-1]
            train_parts = [
                a + b.tolist() for a, b in zip(train_parts, np.split(train_k, cuts_train), strict=True)
            ]
            test_parts = [
                a + b.tolist() for a, b in zip(test_parts, np.split(test_k, cuts_test), strict=True)
            ]
        if min(len(x) for x in train_parts + test_parts) >= LABELDIR_MIN_SIZE:
            break
    else:
        raise PartitionError(
            f"fl.partition=dirichlet_labeldir: no draw in {LABELDIR_MAX_DRAWS} gave every client "
            f"{LABELDIR_MIN_SIZE} train and test images ({n_train} images, {clients} clients, fl.alpha={beta})"
        )
    for j in range(clients):
        rng.shuffle(train_parts[j])
        rng.shuffle(test_parts[j])
    settings = {"alpha": float(beta), "client_test": [[int(i) for i in t] for t in test_parts]}
    keys = item_keys if item_keys is not None else [str(y) for y in train_labels]
    assigned = [[int(i) for i in t] for t in train_parts]
    return Partition("dirichlet_labeldir", seed, settings, assigned, items_digest(keys), list(train_labels))


# CIFAR-100's coarse label of each fine label (its meta file's mapping), as the originals list it
CIFAR100_COARSE = (
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11, 6, 11, 5, 10, 7, 6, 13, 15, 3, 15,
    0, 11, 1, 10, 12, 14, 16, 9, 11, 5, 5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13, 16, 19, 2, 4, 6, 19, 5, 5, 8, 19,
    18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
)  # fmt: skip
LABELDIR100_SEED = 12345  # partition_data's own seed for noniid-labeldir100
LABELDIR100_FINE_ALPHA = 10.0  # its fixed concentration over the fine labels of a coarse label


def _renormalize(weights, index: int):
    """The weights without entry `index`, summing to 1 again (the originals' `renormalize`)."""
    import numpy as np

    out = np.delete(weights, index)
    return out / out.sum()


def labeldir100_partition(
    train_labels: list[int],
    test_labels: list[int],
    *,
    beta: float,
    clients: int,
    seed: int,
    item_keys: list[str] | None = None,
) -> Partition:
    """The originals' `noniid-labeldir100` for CIFAR-100 (fine labels 0..99 in CIFAR-100's order).

    On the train and test images together (test indices after the train ones), with Python's and
    numpy's streams both seeded with the function's own 12345: the images are listed in a random
    order per fine and per coarse label; each client in turn draws coarse weights ~ Dir(beta) over
    the coarse labels left and fine weights ~ Dir(10) within each, then N_images // N_clients times
    picks a coarse label and a fine label by one multinomial draw each, and takes a random image
    of it (`random.choice`); an exhausted fine label (and then coarse label) leaves the draw, its
    weights renormalised. The client lists are finally shuffled with the run's own Python stream
    (`random.shuffle` after Dassl's `random.seed(data.seed)`), then split into train and test.

    Args:
        train_labels, test_labels: CIFAR-100's fine labels of the train and test splits.
        beta: the concentration over the coarse labels (`fl.alpha`).
        clients: `fl.clients`.
        seed: `data.seed` (only the final order of the clients depends on it).
        item_keys: one string per train item for the recorded items hash.
    """
    import numpy as np

    if max(train_labels) >= len(CIFAR100_COARSE):
        raise PartitionError("fl.partition=dirichlet_labeldir100 needs CIFAR-100's 100 fine labels")
    y, n_train = list(train_labels) + list(test_labels), len(train_labels)
    rng, nrng = random.Random(LABELDIR100_SEED), np.random.RandomState(LABELDIR100_SEED)
    order = rng.sample(list(range(len(y))), len(y))
    by_fine = {k: [] for k in range(len(CIFAR100_COARSE))}
    by_coarse = {k: [] for k in range(max(CIFAR100_COARSE) + 1)}
    for i in order:
        by_fine[y[i]].append(i)
        by_coarse[CIFAR100_COARSE[y[i]]].append(i)
    available = list(by_coarse)
    fine_of = {k: [] for k in by_coarse}
    for fine, coarse in enumerate(CIFAR100_COARSE):
        fine_of[coarse].append(fine)
    drawn = [[] for _ in range(clients)]
    for k in range(clients):
        coarse_w = nrng.dirichlet(beta * np.ones(len(fine_of)))
        fine_w = {c: nrng.dirichlet(LABELDIR100_FINE_ALPHA * np.ones(len(f))) for c, f in fine_of.items()}
        for _ in range(len(y) // clients):
            ci = int(np.argmax(nrng.multinomial(1, coarse_w)))
            c = available[ci]
            fi = int(np.argmax(nrng.multinomial(1, fine_w[c])))
            f = fine_of[c][fi]
            idx = int(rng.choice(list(by_fine[f])))
            drawn[k].append(idx)
            by_fine[f].remove(idx)
            by_coarse[c].remove(idx)
            if not by_fine[f]:
                fine_of[c].remove(f)
                fine_w[c] = _renormalize(fine_w[c], fi)
                if not by_coarse[c]:
                    fine_of.pop(c)
                    available.remove(c)
                    coarse_w = _renormalize(coarse_w, ci)
    random.Random(seed).shuffle(drawn)
    train = [[i for i in d if i < n_train] for d in drawn]
    settings = {
        "alpha": float(beta),
        "client_test": [[i - n_train for i in d if i >= n_train] for d in drawn],
    }
    keys = item_keys if item_keys is not None else [str(v) for v in train_labels]
    return Partition("dirichlet_labeldir100", seed, settings, train, items_digest(keys), list(train_labels))


def client_test_sets(part: Partition, test_labels: list[int]) -> list[list[int]]:
    """Each client's test set (indices into the test split): the partition's own where it has one
    (pathological_fedotp), else every test image of the classes in the client's training items."""
    if "client_test" in part.settings:
        return [list(t) for t in part.settings["client_test"]]
    out = []
    for idx in part.clients:
        own = {part.labels[i] for i in idx}
        out.append([i for i, y in enumerate(test_labels) if y in own])
    return out
