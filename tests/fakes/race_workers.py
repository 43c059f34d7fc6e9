"""Racing store processes for tests/test_slot_races.py (spawned: each its own interpreter, its
own kubernetes client and KubeStore over HTTP to the test server).

Phases, each opened and closed by the driver through `phase` (a Barrier of workers + driver):
  1. "same_node": every round, all workers decide a settled alarm about the same fresh node at
     once (two daemons on one node), through apply_event;
  2. "register": each worker gives its own share of fresh nodes their first state, racing the
     others into the shards while counts (made frequent) run;
  3. "takeover": every round, all workers claim a reboot slot of a pool whose every slot has
     expired, for their own node.
Results go to `out` as (phase, worker, data).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMESPACE = "screener-system"


def worker(i: int, url: str, plan: dict[str, Any], phase: Any, rounds: Any, out: Any) -> None:
    try:
        _work(i, url, plan, phase, rounds, out)
    except BaseException:  # noqa: BLE001 - told to the driver, which fails the test
        out.put(("error", i, traceback.format_exc()))
        phase.abort()
        rounds.abort()


def _store(url: str, instance: str) -> Any:
    import kubernetes.client

    from screener.stores.kube import KubeStore

    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = url, False
    return KubeStore(kubernetes.client.ApiClient(cfg), namespace=NAMESPACE, instance=instance)


def _work(i: int, url: str, plan: dict[str, Any], phase: Any, rounds: Any, out: Any) -> None:
    from screener.lifecycle.apply import apply_event
    from screener.lifecycle.machine import NodeSeen
    from screener.stores.slots import KubeSlots
    from screener.alarmfile import AlarmRecord
    from screener.types import SuspectNode

    store = _store(url, f"racer-{i}")
    phase.wait()  # 1: same_node
    errors = []
    for r in range(plan["same_node_rounds"]):
        node = f"twin-{r}"
        rounds.wait()
        record = AlarmRecord(alarm_id=f"a-{r}-{i}", check="ring_replay", step=3, settled=True,
                             suspect_ranks=(0,), suspect_nodes=(SuspectNode(node, node),),
                             node=node, job="train", created=time.time() - 1)
        try:
            apply_event(store, node, record, now=time.time())
        except Exception as e:  # noqa: BLE001 - reported; a lost race is no error
            errors.append(f"{node}: {type(e).__name__}: {e}")
    out.put(("same_node", i, errors))
    phase.wait()  # end of 1

    phase.wait()  # 2: register
    store.budget.max_registered = plan["max_registered"]
    errors = []
    for node in plan["register"][i]:
        try:
            apply_event(store, node, NodeSeen(), now=time.time())
        except Exception as e:  # noqa: BLE001
            errors.append(f"{node}: {type(e).__name__}: {e}")
    out.put(("register", i, errors))
    phase.wait()  # end of 2

    phase.wait()  # 3: takeover
    got = []
    for r in range(plan["takeover_rounds"]):
        slots = KubeSlots(store.calls, f"reboot{r}", plan["capacity"], ttl=60.0,
                          clock=time.time)
        rounds.wait()
        claim = slots.claim(f"racer-node-{i}")
        got.append(claim.index if claim is not None else None)
    out.put(("takeover", i, got))
    phase.wait()  # end of 3
    store.close()
