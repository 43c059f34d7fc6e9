"""The fleet semaphore (issue 37.3): one primitive for the quarantine budget's slots and the
reboot slots, claim by create, release by a uid-preconditioned delete, one place per node.

The official client over HTTP against the Kubernetes API test server (tests/fakes/kubeapi.py),
each racer its own KubeStore; the local store's pool in its SQLite file.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from fakes.kubeapi import KubeAPI
from screener.stores.kube import KubeStore
from screener.stores.kube import formats as kf
from screener.stores.kube.semaphore import Semaphore
from screener.stores.local import LocalStore
from screener.stores.slots import KubeSlots, SlotClaim, SqliteSlots

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "screener-system"


def _store(server: KubeAPI, instance: str = "t") -> KubeStore:
    return KubeStore(server.api_client(), namespace=NAMESPACE, sleep=lambda s: None,
                     clock=lambda: 1000.0, instance=instance)


def _pool(store: KubeStore) -> Semaphore[SlotClaim]:
    return store.slots("reboot", 3, ttl=60.0, clock=lambda: 1000.0).places


def _body(pool: str, index: int, node: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"screener-{pool}-slot-{index}", "namespace": NAMESPACE,
                         "labels": {**kf.MANAGED_BY, "screener.io/slot-pool": pool}},
            "data": {"node": node, "since": "1000.0"}}


def test_a_taken_place_is_refused_and_a_stale_uid_frees_nothing():
    with KubeAPI() as server:
        places = _pool(_store(server))
        first = places.take(_body("reboot", 0, "a"))
        assert first == SlotClaim(0, "a", 1000.0)
        assert places.take(_body("reboot", 0, "b")) is None  # the name is taken: 409
        old_uid = places.places()[0].uid
        assert places.free(0, old_uid)
        assert places.take(_body("reboot", 0, "b")) is not None  # taken over
        assert not places.free(0, old_uid)  # the old holder's release frees nothing now
        assert {i: p.claim.node for i, p in places.places().items()} == {0: "b"}
        assert places.look(0)["data"]["node"] == "b" and places.look(1) is None
        with pytest.raises(ValueError, match="claimed by a create"):
            body = _body("reboot", 1, "c")
            body["metadata"]["resourceVersion"] = "7"
            places.take(body)


def test_one_place_per_node_keeps_the_lowest_whoever_settles():
    with KubeAPI() as server:
        places = _pool(_store(server))
        for index in (2, 0, 1):
            assert places.take(_body("reboot", index, "twin")) is not None
        places.take(_body("reboot", 3, "other"))
        kept, freed = places.keep_lowest("twin")
        assert kept is not None and kept.index == 0 and sorted(c.index for c in freed) == [1, 2]
        assert places.keep_lowest("twin") == (kept, [])  # a second settle agrees, frees nothing
        kept, freed = places.keep_lowest("twin", keep=False)
        assert kept is None and [c.index for c in freed] == [0]
        assert {p.claim.node for p in places.places().values()} == {"other"}


def test_a_hand_made_configmap_in_the_pool_holds_no_place():
    with KubeAPI() as server:
        places = _pool(_store(server))
        junk = _body("reboot", 1, "x")
        junk["data"] = {"note": "not a claim"}
        assert places.take(junk) is None  # created, but no claim parses from it
        assert places.places() == {}
        assert places.look(1) is not None  # the name is taken all the same


@pytest.mark.timeout(120)
def test_racers_never_hold_one_place_twice_on_either_pool():
    """Twelve racers, each its own client, take the same three names of both pools at once:
    each name has one holder, and the budget's and the reboot pool's never mix."""
    with KubeAPI() as server:
        stores = [_store(server, f"r{k}") for k in range(12)]
        won: dict[str, list[tuple[int, str]]] = {"reboot": [], "budget": []}
        go = threading.Barrier(len(stores))
        lock = threading.Lock()

        def race(k: int, store: KubeStore) -> None:
            node = f"node-{k}"
            go.wait(timeout=30)
            for index in range(3):
                if _pool(store).take(_body("reboot", index, node)) is not None:
                    with lock:
                        won["reboot"].append((index, node))
                body = kf.slot_configmap(index, node, "quarantined", 1000.0, namespace=NAMESPACE)
                if store.budget.slots.take(body) is not None:
                    with lock:
                        won["budget"].append((index, node))

        threads = [threading.Thread(target=race, args=(k, s)) for k, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        for pool in ("reboot", "budget"):
            assert sorted(i for i, _ in won[pool]) == [0, 1, 2], won[pool]
        reboot = {i: p.claim.node for i, p in _pool(stores[0]).places().items()}
        budget = {i: p.claim.node for i, p in stores[0].budget.slots.places().items()}
        assert reboot == dict(won["reboot"]) and budget == dict(won["budget"])


def test_each_store_hands_out_its_own_pool(tmp_path):
    with KubeAPI() as server:
        slots = _store(server).slots("reboot", 1, ttl=60.0, clock=lambda: 1000.0)
        assert isinstance(slots, KubeSlots)
        assert slots.claim("a") == SlotClaim(0, "a", 1000.0) and slots.claim("b") is None
        slots.release("a")
        assert slots.claim("b") is not None
    with LocalStore(str(tmp_path / "state.db")) as store:
        local = store.slots("reboot", 1, ttl=60.0, clock=lambda: 1000.0)
        try:
            assert isinstance(local, SqliteSlots)
            assert local.claim("a") == SlotClaim(0, "a", 1000.0) and local.claim("b") is None
            local.release("a")
            assert local.claim("b") is not None
        finally:
            local.close()


def test_only_the_semaphore_deletes_configmaps():
    """The release rule has one home: no other module of screener calls the delete."""
    calls = []
    for path in sorted((ROOT / "screener").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "cm_delete" and \
                    isinstance(node.ctx, ast.Load):
                calls.append(str(path.relative_to(ROOT)))
    assert calls == ["screener/stores/kube/semaphore.py"], calls
