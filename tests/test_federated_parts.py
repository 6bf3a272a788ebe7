"""Federated parts without a simulation: partitions, sampling, aggregation, latent-domain prompts,
the multi-domain reader, bad input and the simulation's reaper. Also `make_multidomain`, the
generated multi-domain folder (the same classes drawn in three visual styles) that test_federated.py
uses."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from coop.data import DataError
from coop.data.multidomain import build_multidomain, domain_of, read_multidomain

STYLES = ("photo", "sketch", "stripes")
COLOURS = {"red_thing": (200, 40, 40), "green_thing": (40, 200, 40), "blue_thing": (40, 40, 200)}


def make_multidomain(root: Path, n: int = 6, corrupt: str | None = None) -> Path:
    """root/<style>/<class>/<i>.png: a colour per class, drawn as a plain patch (photo), an outline
    on white (sketch) or stripes on grey (stripes). `corrupt`: a relative path to write as garbage."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for style in STYLES:
        for name, colour in COLOURS.items():
            folder = root / style / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                c = torch.tensor(colour).view(1, 1, 3).expand(32, 32, 3).clone()
                if style == "sketch":
                    c[4:-4, 4:-4] = 235
                elif style == "stripes":
                    c[::4] = 90
                    c[1::4] = 90
                noise = torch.randint(-20, 20, (32, 32, 3), generator=gen)
                pixels = (c + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    if corrupt:
        (root / corrupt).write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def multidomain(tmp_path_factory):
    return make_multidomain(tmp_path_factory.mktemp("multidomain"))


# ---------------------------------------------------------------- multi-domain data


def test_multidomain_reader(multidomain):
    src = read_multidomain(multidomain)
    assert src.classnames == sorted(COLOURS)
    per_domain = {s: [d for d in src.train if domain_of(d, src.image_dir) == s] for s in STYLES}
    assert all(len(v) == 3 * 5 for v in per_domain.values())  # 6 per class: 0 val, 1 test, 5 train
    assert len(src.test) == 9 and not src.val

    held = read_multidomain(multidomain, target_domain="sketch")
    assert {domain_of(d, held.image_dir) for d in held.test} == {"sketch"} and len(held.test) == 18
    assert {domain_of(d, held.image_dir) for d in held.train} == {"photo", "stripes"}
    assert len(held.train) == 36  # the source domains' train and test parts
    assert not {d.path for d in held.train} & {d.path for d in held.test}

    few = build_multidomain(multidomain, "sketch", shots=2, seed=1)
    assert len(few.train) == 6 and (multidomain / ".heldout-sketch" / "split_fewshot").is_dir()
    assert read_multidomain(multidomain).classnames == src.classnames  # caches are not domains

    with pytest.raises(DataError, match="target_domain='clipart' is not a domain"):
        read_multidomain(multidomain, target_domain="clipart")


# ---------------------------------------------------------------- partitions and sampling


def test_partitions_are_flower_datasets_partitions_deterministic_in_the_seed():
    from coop.federated.partition import PartitionError, partition

    rng = random.Random(0)
    labels = [rng.randrange(5) for _ in range(300)]
    domains = [rng.choice(STYLES) for _ in range(300)]
    for scheme, kw in [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.1}),
        ("pathological", {"classes_per_client": 2}),
    ]:
        first = partition(labels, domains, scheme=scheme, clients=4, seed=1, **kw)
        assert first.clients == partition(labels, domains, scheme=scheme, clients=4, seed=1, **kw).clients
        assert first.clients != partition(labels, domains, scheme=scheme, clients=4, seed=2, **kw).clients
        assert all(first.clients) and len(set().union(*map(set, first.clients))) == sum(first.sizes())
        if scheme != "pathological":  # which classes pathological clients draw may leave one out
            assert sum(first.sizes()) == 300
    iid = partition(labels, None, scheme="iid", clients=4, seed=1)
    assert iid.sizes() == [75] * 4
    patho = partition(labels, None, scheme="pathological", clients=4, seed=1, classes_per_client=2)
    assert all(len({labels[i] for i in c}) <= 2 for c in patho.clients)
    skewed = partition(labels, None, scheme="dirichlet", clients=4, seed=1, alpha=0.1)
    assert max(len({labels[i] for i in c}) for c in skewed.clients) < 5 or max(skewed.sizes()) > 100

    by_domain = partition(labels, domains, scheme="domain", clients=3, seed=1)
    assert [{domains[i] for i in c} for c in by_domain.clients] == [{s} for s in sorted(STYLES)]
    assert by_domain.to_json()["client_domains"] == sorted(STYLES)
    with pytest.raises(PartitionError, match="set fl.clients=3"):
        partition(labels, domains, scheme="domain", clients=4, seed=1)
    with pytest.raises(PartitionError, match="more than the 300 training images"):
        partition(labels, None, scheme="iid", clients=301, seed=1)


def test_client_sampling_is_seeded_by_seed_and_round():
    from coop.federated.strategy import sample_clients

    assert sample_clients(1, 5, 10, 1.0) == list(range(10))
    picks = [sample_clients(1, r, 10, 0.3) for r in range(1, 6)]
    assert all(len(p) == 3 and p == sorted(p) for p in picks)
    assert picks == [sample_clients(1, r, 10, 0.3) for r in range(1, 6)]
    assert len({tuple(p) for p in picks}) > 1  # rounds differ
    assert len(sample_clients(1, 1, 3, 0.1)) == 1  # at least one client


# ---------------------------------------------------------------- aggregation


def test_aggregation_rules():
    from coop.federated.strategy import aggregate

    current = {"ctx": torch.zeros(2), "domain0.ctx": torch.ones(2), "domain1.ctx": torch.full((2,), 5.0)}
    replies = [
        {"tensors": {"ctx": torch.full((2,), 1.0), "domain0.ctx": torch.full((2,), 3.0)}, "num_examples": 1,
         "usage": [4, 0]},
        {"tensors": {"ctx": torch.full((2,), 4.0), "domain0.ctx": torch.full((2,), 9.0)}, "num_examples": 3,
         "usage": [2, 0]},
    ]  # fmt: skip
    fedavg = aggregate(current, replies, "fedavg", beta=0.5)
    assert torch.allclose(fedavg["ctx"], torch.full((2,), (1 * 1 + 3 * 4) / 4))
    # D_0 <- beta * D_0 + (1 - beta) * (mean weighted by routed samples); D_1 unused: unchanged
    assert torch.allclose(fedavg["domain0.ctx"], torch.full((2,), 0.5 * 1 + 0.5 * (4 * 3 + 2 * 9) / 6))
    assert torch.equal(fedavg["domain1.ctx"], current["domain1.ctx"])
    uniform = aggregate(current, replies, "uniform", beta=0.0)
    assert torch.allclose(uniform["ctx"], torch.full((2,), 2.5))
    assert torch.allclose(uniform["domain0.ctx"], torch.full((2,), 6.0))
    assert torch.equal(aggregate(current, replies, "fedprox", beta=0.5)["ctx"], fedavg["ctx"])


def test_fedprox_term_pulls_towards_the_global_prompt(tiny_clip):
    from coop.federated.client import local_train
    from coop.methods import CoOp

    cfg = OmegaConf.create(
        {"prompt": {"n_ctx": 2, "ctx_init": None, "position": "end", "csc": False, "depth": 1}}
    )
    gen = torch.Generator().manual_seed(0)  # not the global RNG: the result must not depend on test order
    feats, labels = torch.randn(1, 8, tiny_clip.embed_dim, generator=gen), torch.tensor([0, 1] * 4)
    moved = {}
    for mu in (0.0, 5.0):
        torch.manual_seed(0)
        method = CoOp(tiny_clip, ["red thing", "blue thing"], cfg)
        anchor = {k: v.detach().clone() for k, v in method.learnable().items()}
        kw = {"epochs": 3, "batch_size": 4, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "seed": 1}
        stats = local_train(method, feats, labels, mu=mu, anchor=anchor, **kw)
        assert stats["num_examples"] == 8 and stats["loss"] > 0
        moved[mu] = (method.learnable()["ctx"] - anchor["ctx"]).norm()
    assert moved[5.0] < 0.8 * moved[0.0]


# ---------------------------------------------------------------- latent domains


def ld_cfg(position="end", depth=2, k=3, w=0.5):
    return OmegaConf.create(
        {
            "prompt": {"n_ctx": 2, "ctx_init": None, "position": position, "csc": False, "depth": depth},
            "fl": {"domains": k, "ensemble_weight": w},
        }
    )


@pytest.mark.parametrize("position", ["end", "middle"])
def test_latent_domains_rules(tiny_clip, position):
    import torch.nn.functional as F

    from coop.federated.latent_domains import LatentDomains, domain_of_key

    torch.manual_seed(0)
    method = LatentDomains(tiny_clip, ["red thing", "green thing", "blue thing"], ld_cfg(position))
    keys = set(method.learnable())
    assert keys == {"global.ctx", "global.deep_ctx", "query"} | {f"domain{k}.{n}" for k in range(3) for n in
                                                                   ("ctx", "deep_ctx")}  # fmt: skip
    assert [domain_of_key(k) for k in ("global.ctx", "query", "domain2.deep_ctx")] == [None, None, 2]
    with torch.no_grad():  # distinct queries so that samples route differently
        method.query.copy_(torch.randn(3, tiny_clip.embed_dim))
    feats, labels = torch.randn(6, tiny_clip.embed_dim), torch.tensor([0, 1, 2, 0, 1, 2])

    # inference: w * logits_G + (1 - w) * sum_k softmax(scores)_k * logits_D_k
    text_g, text_d = method.prepare()
    scale = tiny_clip.logit_scale.exp()
    img = F.normalize(feats, dim=-1)
    scores = scale * img @ F.normalize(method.query, dim=-1).T
    expected = 0.5 * scale * img @ F.normalize(text_g, dim=-1).T + 0.5 * sum(
        scores.softmax(-1)[:, k : k + 1] * scale * img @ F.normalize(text_d[k], dim=-1).T for k in range(3)
    )
    torch.testing.assert_close(method.logits(feats, (text_g, text_d)), expected, rtol=1e-5, atol=1e-5)

    # training: only the routed domain prompts and the query learn from a sample
    method.train()
    method.reset_usage()
    routed = scores.argmax(-1)
    loss, logits = method.loss(feats, labels)
    loss.backward()
    assert logits.shape == (6, 3) and int(method.usage.sum()) == 6
    assert method.usage.tolist() == torch.bincount(routed, minlength=3).tolist()
    for k in range(3):
        grad = method.learnable()[f"domain{k}.ctx"].grad
        used = bool((routed == k).any())
        assert (grad is not None and grad.abs().sum() > 0) == used, k
    assert method.query.grad.abs().sum() > 0 and method.learnable()["global.deep_ctx"].grad.abs().sum() > 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fl.partition=domain"], "fl.partition=domain needs data.name=multidomain"),
        (["data.target_domain=sketch"], "data.target_domain needs data.name=multidomain"),
        (["fl.clients=0"], "fl.clients must be an integer >= 1"),
        (["fl.fraction=0"], "fl.fraction must be a number in (0, 1]"),
        (["train.aug_views=0"], "federated clients train on cached features"),
        (["method=zeroshot"], "federated runs choose their method with fl.method"),
    ],
)
def test_bad_config_is_one_line(args, message):
    from coop.config.checks import ConfigError
    from coop.config.load import load_config
    from coop.federated.task import check_config

    with pytest.raises(ConfigError, match=None) as e:
        check_config(load_config(None, ["data.name=imagefolder", "train.aug_views=1", *args]))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tool_bad_input_is_one_line_before_any_simulation(image_folder, tmp_path):
    from conftest import REPO, TINY_CONFIG

    cmd = [sys.executable, str(REPO / "tools" / "federated.py"), f"model.name={TINY_CONFIG}", "model.pretrained=none",
           "data.name=imagefolder", f"data.root={image_folder}", "data.shots=0", f"output_dir={tmp_path}/run",
           "fl.clients=100", "fl.aggregation=median"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=os.environ.copy(), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: fl.aggregation must be one of fedavg, uniform, fedprox, last_client, got 'median'"
    ]
    from conftest import run_tool_in_process

    proc = run_tool_in_process(REPO / "tools" / "federated.py", cmd[2:-1])  # the same, without a new Python
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: fl.clients=100 is more than the 18 training images"
    proc = run_tool_in_process(
        REPO / "tools" / "federated.py", ["--num-cpus", "1", "--cpus-per-client", "2", *cmd[2:-2]]
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: --num-cpus 1 is less than --cpus-per-client 2"
    )
    assert not (tmp_path / "run").exists()


# A "tool" that starts a run's processes as Flower does: one that leads a session of its own (the
# SuperExec), which starts another whose environment lacks the marker (a Ray worker after it set its
# process title), and one unmarked process outside the run.
FAKE_TOOL = """
import importlib.util, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("reaper", sys.argv[3])  # without importing coop (torch)
reaper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reaper)
marker, exit_normally = sys.argv[1], sys.argv[2] == "exit"
child = (
    "import os, subprocess, sys, time; env = {k: v for k, v in os.environ.items() if k != sys.argv[1]}; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env=env); time.sleep(60)"
)
with reaper.reaped(marker):
    env = {**os.environ, reaper.RUN_VAR: marker}
    leader = subprocess.Popen([sys.executable, "-c", child, reaper.RUN_VAR], env=env, start_new_session=True)
    while len(reaper.scan(marker, sessions=reaper.scan(marker)[1])[0]) < 2:  # the leader, its unmarked child
        time.sleep(0.05)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    print(other.pid, leader.pid, flush=True)
    time.sleep(0 if exit_normally else 60)
"""


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_no_process_of_a_run_outlives_its_tool(tmp_path, how):
    """The reaper (coop.federated.reaper) ends every process that carries the run's marker, and those
    in the sessions they lead, when the tool is SIGKILLed or leaves the block normally; it spares
    the rest."""
    import signal

    from coop.federated import reaper

    marker = f"test-{os.getpid()}-{how}"
    cmd = [sys.executable, "-c", FAKE_TOOL, marker, how, reaper.__file__]
    tool = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    other, leader = map(int, tool.stdout.readline().split())
    session = {leader: reaper.start_time(leader)}
    run = lambda: reaper.scan(marker, sessions=session)[0]  # noqa: E731 - the run's processes
    try:
        if how == "sigkill":
            assert len(run()) == 2, run()  # the session's leader (marked) and its unmarked child
            tool.kill()
        assert tool.wait(30) == (-signal.SIGKILL if how == "sigkill" else 0)
        gone = _wait_for(lambda: not run(), 5 if how == "sigkill" else 0)
        assert gone, run()
        os.kill(other, 0)  # not the run's: still running
    finally:
        os.kill(other, signal.SIGKILL)
        for pid in run():
            os.kill(pid, signal.SIGKILL)


# A session leader (marked when the test says so) that starts an unmarked process in its session,
# prints that process's pid, and exits when its stdin closes.
LEADER = (
    "import os, subprocess, sys; env = {k: v for k, v in os.environ.items() if k != sys.argv[1]}; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env=env); "
    "print(child.pid, flush=True); sys.stdin.read()"
)


def _session(env: dict) -> tuple[subprocess.Popen, int]:
    """(a LEADER started with `env`, the pid of the process it started)."""
    from coop.federated.reaper import RUN_VAR

    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, RUN_VAR], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    return leader, int(leader.stdout.readline())


def _alive(pid: int) -> bool:  # a zombie is not: its parent may be gone, and nothing reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_reaper_spares_a_session_whose_id_another_process_leads_now():
    """A session noted during the run whose id (its leader's pid) another process has taken since:
    the leader noted exited, its session emptied, and the pid went to a new session leader. The
    reaper tells them apart by the leader's start time (/proc/<pid>/stat field 22); the session it
    noted, led by the process it noted, it still kills, with every process in it."""
    import signal

    from coop.federated import reaper

    marker = f"test-{os.getpid()}-reused"
    leader, member = _session({k: v for k, v in os.environ.items() if k != reaper.RUN_VAR})  # not the run's
    try:
        start = reaper.start_time(leader.pid)
        reused = {leader.pid: start - 1}  # noted with the start time of the process that had the pid before
        assert reaper.scan(marker, sessions=reused) == ([], {})  # neither it nor its member, and dropped
        assert reaper.end_run(marker, reused, timeout=1.0) == 0
        assert _alive(leader.pid) and _alive(member)
        noted = {leader.pid: start}  # the process that the reaper saw leading it: the run's
        assert sorted(reaper.scan(marker, sessions=noted)[0]) == sorted([leader.pid, member])
        assert reaper.end_run(marker, noted) == 2
        assert leader.wait(10) == -signal.SIGKILL and _wait_for(lambda: not _alive(member), 5)
    finally:
        for pid in (leader.pid, member):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        leader.wait()


def test_the_reaper_kills_what_is_left_of_a_noted_session_after_its_leader_exited():
    """The SuperExec leads the run's session and may exit first: what it leaves in the session (here
    a process without the marker) is found through the session noted while it ran, and killed."""
    import signal

    from coop.federated import reaper

    marker = f"test-{os.getpid()}-left"
    leader, member = _session({**os.environ, reaper.RUN_VAR: marker})
    try:
        noted = reaper.scan(marker)[1]
        assert noted == {leader.pid: reaper.start_time(leader.pid)}
        leader.stdin.close()
        assert leader.wait(10) == 0 and reaper.start_time(leader.pid) is None
        assert reaper.scan(marker)[0] == []  # the marker alone no longer finds it
        assert reaper.scan(marker, sessions=noted) == ([member], noted)
        assert reaper.end_run(marker, noted) == 1 and _wait_for(lambda: not _alive(member), 5)
    finally:
        with contextlib.suppress(OSError):
            os.kill(member, signal.SIGKILL)


def test_an_error_of_the_serverapp_is_raised_again_in_the_tool():
    from coop.config.checks import ConfigError
    from coop.federated.server import FederatedError
    from coop.federated.simulation import raise_remote

    with pytest.raises(ConfigError, match="^fl.rounds=0 must be >= 1$"):
        raise_remote(
            {"error": "fl.rounds=0 must be >= 1", "type": "ConfigError", "module": "coop.config.load"}
        )
    with pytest.raises(FederatedError, match="^round 2: client 1 failed$"):
        raise_remote({"error": "round 2: client 1 failed", "type": "FederatedError",
                      "module": "coop.federated.server"})  # fmt: skip
    with pytest.raises(FederatedError, match="^KeyError: 'x'$"):  # a class not rebuilt from its text
        raise_remote({"error": "'x'", "type": "KeyError", "module": "builtins"})


def test_a_lost_actors_error_is_one_line_with_its_pid_and_cause():
    """Ray's texts (abridged) for an actor whose process died and for one that Ray's memory monitor
    killed, as the server's log line gives them (coop.federated.ray_pool)."""
    from ray.exceptions import OutOfMemoryError

    from coop.federated.ray_pool import describe

    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ClientAppActor\n\tactor_id: 676d\n"
        "\tpid: 12875\n\tip: 192.0.2.2\nThe actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2."
    )
    assert describe(died) == "its Ray actor (pid 12875) died (SYSTEM_ERROR); a new actor takes its place"
    oom = OutOfMemoryError(
        "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: e92b) "
        "was 22.40GB / 23.54GB (0.951548), which exceeds the memory usage threshold of 0.950000; Ray killed 1 "
        "worker(s) based on the killing policy: [(Task: task name=ClientAppActor.run, pid=29525, actual memory "
        "used=1.10GB)]"
    )
    assert describe(oom) == (
        "its Ray actor (pid 29525) died (Ray's memory monitor: the machine's memory use 0.952 > 0.950); "
        "a new actor takes its place"
    )
