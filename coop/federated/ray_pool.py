"""A lost Ray actor in Flower 1.42's simulation: its client fails for the round, a new actor takes its place.

`flwr-simulation` runs every message of a round on an actor of Flower's `BasicActorPool` (as many
actors as the machine's CPUs hold `client-resources-num-cpus`; the simulation of
`tools/federated.py` on 2 cores has one). When an actor's process dies (Ray's memory monitor kills
workers when the machine's memory use passes `RAY_memory_usage_threshold`, 0.95 by default,
whatever process uses it; the kernel's OOM killer; a `kill`), `ray.get` raises a `RayActorError`
(an `OutOfMemoryError` when the memory monitor killed it), and Flower 1.42
(`RayBackend.process_message`) turns it into an error reply for that message, logs Ray's 20-line
traceback, and puts the dead actor back into the pool. Ray does not restart it
(Flower creates its actors without `max_restarts`, and the simulation's federation config has no
key for it), so every later message sent to that actor fails too: with one actor, every client
of the run fails from then on and the run stops with "every sampled client failed".

`install()`, which `coop.federated.app` calls when Flower loads it in `flwr-simulation`, wraps the
pool's `fetch_result_and_return_actor_to_pool`: when the actor that ran a message is lost, a new
actor replaces it in the pool, and the message fails with `ActorLost`, whose one line the server
logs (`round 2: client 0 failed: its Ray actor (pid 1234) died (SYSTEM_ERROR); a new actor takes
its place`). The round goes on with the other clients (`fl.on_client_failure=continue`); the
lost client trains again when it is next sampled. The actor is not retried within the round: a
client whose training needs more memory than the machine has would be killed again. Under a Flower
release outside the tested range the pool is left as Flower made it (`coop.versions`).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from flwr.clientapp.client_app import ClientAppException

from coop.versions import untested

log = logging.getLogger(__name__)


class ActorLost(ClientAppException):
    """The Ray actor that ran a client's message died (Flower reports its message after "Message: ")."""


def describe(error: Exception) -> str:
    """One line for a lost actor's error (`RayActorError`, or `OutOfMemoryError` when Ray's memory
    monitor killed it): the actor's pid and why, where Ray's text gives them."""
    text = str(error)
    pid = re.search(r"\bpid[:=] ?(\d+)", text)
    usage = re.search(r"\(([\d.]+)\), which exceeds the memory usage threshold of ([\d.]+)", text)
    kind = re.search(r"Worker exit type: (\w+)", text)
    if usage:
        why = f"Ray's memory monitor: the machine's memory use {float(usage[1]):.3f} > {float(usage[2]):.3f}"
    else:
        why = kind[1] if kind else type(error).__name__
    return f"its Ray actor{f' (pid {pid[1]})' if pid else ''} died ({why}); a new actor takes its place"


def install() -> bool:
    """In Flower's simulation process (`flwr-simulation`) only: replace lost actors (see the module
    docstring). Returns whether the pool is wrapped (once per process). Under a Flower release
    outside the tested range (`coop.versions`) it logs that in one line and wraps nothing: the pool
    is Flower's private class."""
    if Path(sys.argv[0]).name != "flwr-simulation":
        return False
    problem = untested("flwr")
    if problem:
        log.warning("%s: a lost Ray actor is not replaced (coop.federated.ray_pool)", problem)
        return False
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool
    from ray.exceptions import OutOfMemoryError, RayActorError

    fetch = BasicActorPool.fetch_result_and_return_actor_to_pool
    if getattr(fetch, "coop_replaces_lost_actors", False):
        return True

    def fetch_or_replace(pool: BasicActorPool, future):
        try:
            return fetch(pool, future)
        except (RayActorError, OutOfMemoryError) as e:  # the latter: Ray's memory monitor
            # Flower's caller puts the actor that ran `future` back into the pool (its
            # `add_actor_back_to_pool`): make that a new one
            if future in pool._future_to_actor:
                pool._future_to_actor[future] = pool.create_actor_fn()
            raise ActorLost(describe(e)) from None

    fetch_or_replace.coop_replaces_lost_actors = True
    BasicActorPool.fetch_result_and_return_actor_to_pool = fetch_or_replace
    return True
