"""A transition is completed after any crash (issue 36.7): what a pass is about to write is on
file (screener.stores.intents) before its first write, and the next pass finishes it.

Real parts only: the Kubernetes API test server (tests/fakes/kubeapi.py) over HTTP through the official
client, the store's journal on disk, and for the campaign real `screener daemon --once` processes
killed with SIGKILL at random moments of a quarantine (tests/fakes/kill9.py says how the kills
land between writes). Before: of 35 kills mid-quarantine, 2 left the label, taint and slot with no
condition and no Event, and the rerun took the alarm for done.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fakes.kill9 import NAMESPACE, Campaign, CampaignTooLong, TappedAPI, audit
from fakes.kubeapi import KubeAPI
from screener.lifecycle.apply import apply_event
from screener.lifecycle.machine import FleetCounts, decide
from screener.stores.intents import IntentJournal
from screener.stores.kube import KubeApiError, KubeStore
from screener.stores.kube import formats as kf
from screener.stores.spool import Spool
from screener.alarmfile import AlarmRecord
from screener.types import LABEL_STATE, NodeState, SuspectNode

NODE = "gpu-1"
NOW = 1_800_000_000.0


def alarm(node: str = NODE, alarm_id: str = "a-1") -> AlarmRecord:
    return AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=3, settled=True,
                       suspect_ranks=(0,), suspect_nodes=(SuspectNode(node, node),), node=node,
                       job="train", created=NOW - 5)


@pytest.fixture
def api():
    with KubeAPI() as server:
        for i in range(30):
            server.add_node(f"fleet-{i}", labels={LABEL_STATE: "healthy"})
        server.add_node(NODE, labels={LABEL_STATE: "healthy"})
        yield server


def store_at(api: KubeAPI, state: Path) -> KubeStore:
    state.mkdir(exist_ok=True)
    return KubeStore(api.api_client(), spool=Spool(state / "spool.db"), namespace=NAMESPACE,
                     clock=lambda: NOW, sleep=lambda s: None, instance=NODE)


def intents(state: Path) -> list[Path]:
    return sorted((state / "intents").glob("*.json"))


def test_a_quarantine_stopped_after_its_node_write_is_finished_whole_and_once(api, tmp_path):
    """The writer stops after the Node patch (the condition refused: the process gone as far as
    the API is concerned); its intent is on file, and the next pass writes the condition, the
    history entry and the Event, with the one slot it claimed; finishing again writes nothing."""
    store = store_at(api, tmp_path / "state")
    api.fail_next(1, 403, verb="patch", subresource="status")
    with pytest.raises(KubeApiError):
        apply_event(store, NODE, alarm(), now=NOW)
    half = audit(api, NODE)
    assert half.label == "quarantined" and half.taint and half.slots == 1
    assert half.condition is None and half.events == 0
    assert len(intents(tmp_path / "state")) == 1
    store.close()

    again = store_at(api, tmp_path / "state")  # the restarted daemon's store
    assert again.finish_intents() == 1
    assert audit(api, NODE).whole, audit(api, NODE)
    assert intents(tmp_path / "state") == []
    writes = len([c for c in api.calls if c.verb in ("create", "update", "patch", "delete")])
    assert again.finish_intents() == 0
    assert len([c for c in api.calls if c.verb in ("create", "update", "patch", "delete")]) == writes
    assert audit(api, NODE).whole
    again.close()


def test_a_decision_stopped_before_its_node_write_is_written_by_the_next_pass(api, tmp_path):
    """Stopped after its slot (the Node write refused): nothing on the Node yet, the node still
    in the state it was decided on; the next pass writes it with the slot it has, not a second."""
    store = store_at(api, tmp_path / "state")
    api.fail_next(1, 403, verb="patch", resource="nodes")
    with pytest.raises(KubeApiError):
        apply_event(store, NODE, alarm(), now=NOW)
    assert audit(api, NODE).label == "healthy" and audit(api, NODE).slots == 1
    assert store_at(api, tmp_path / "state").finish_intents() == 1
    assert audit(api, NODE).whole, audit(api, NODE)


def test_an_intent_on_a_state_another_writer_changed_is_dropped_with_its_slot(api, tmp_path):
    """Decided on healthy, stopped before the Node write; meanwhile a person set the node
    burnin: the intent is dropped (its alarm was not marked done: it is decided again) and the
    slot it claimed is freed."""
    store = store_at(api, tmp_path / "state")
    api.fail_next(1, 403, verb="patch", resource="nodes")
    with pytest.raises(KubeApiError):
        apply_event(store, NODE, alarm(), now=NOW)
    api.mutate(NODE, lambda n: n["metadata"]["labels"].update({LABEL_STATE: "burnin"}))
    assert store_at(api, tmp_path / "state").finish_intents() == 1
    state = audit(api, NODE)
    assert state.label == "burnin" and state.slots == 0 and state.events == 0, state
    assert intents(tmp_path / "state") == []


def test_a_live_writers_intent_is_left_to_it(tmp_path):
    """A finisher takes an intent's lock without waiting: held (its writer is alive, in this or
    another process) it is skipped; the lock the kernel drops with its writer lets it in."""
    t = decide(NODE, NodeState.HEALTHY, alarm(), now=NOW,
               fleet=FleetCounts(total=100, out_of_service=0)).transitions[0]
    writer = IntentJournal(tmp_path / "intents")
    held = writer.write([t])
    assert list(IntentJournal(tmp_path / "intents").unfinished()) == []
    held.release()
    found = list(IntentJournal(tmp_path / "intents").unfinished())
    assert [i.transitions[0].id for i in found] == [t.id]
    found[0].done()
    found[0].release()
    assert list(IntentJournal(tmp_path / "intents").unfinished()) == []
    assert list((tmp_path / "intents").glob("*")) == []  # no lock file left either


def test_an_unreadable_intent_is_set_aside_in_one_line(tmp_path, caplog):
    folder = tmp_path / "intents"
    journal = IntentJournal(folder)
    (folder / "0123456789abcdef.json").write_text('{"schema": "screener.intent/v1", "tr')
    assert list(journal.unfinished()) == []
    assert (folder / "0123456789abcdef.json.unreadable").exists()
    assert "unreadable" in caplog.text and "Traceback" not in caplog.text


@pytest.mark.timeout(300)
def test_kill_9_at_random_moments_leaves_no_half_transition_and_no_double(tmp_path):
    """The campaign's CI slice: at least 30 kills of `screener daemon --once` during a
    quarantine (at a random one of its writes, the write applied and its answer held, or at a
    random time), restarts killed too, then a clean restart: every node whole, none twice. The
    kills did land mid-transition (half states the restart had to finish), each with its intent
    on file. The full campaign: python benchmarks/bench_kill9.py."""
    seed = random.randrange(1 << 30)
    with TappedAPI(hold=(0.01, 0.05), seed=seed) as api:
        # a fleet whose budget (10 %) never binds: a kill that misses moves on to a fresh node,
        # so 30 kills can quarantine 30 nodes or more (past the budget the campaign stops)
        figures = Campaign(api, tmp_path, seed=seed, fleet=600).run(30, kills_per=3)
    report = f"seed {seed}: {figures.to_dict()}"
    assert figures.kills >= 30, report
    assert figures.half == 0 and figures.doubles == 0, report
    assert not figures.bad, report
    assert figures.half_after_kill >= 3, report  # the kills landed between writes
    assert figures.uncovered == 0, report


def test_a_campaign_longer_than_the_budget_stops_before_a_held_node_reads_as_half(tmp_path):
    """Past the budget a node is held in suspect by design (no quarantine taint, entry or
    Event), which the audit would count as a half transition: the campaign refuses to run so
    far. A real-server run once reported one such node as half."""
    with TappedAPI(hold=(0.0, 0.0), seed=1) as api:
        campaign = Campaign(api, tmp_path, seed=1, fleet=200)
        assert campaign.room == 20
        with pytest.raises(CampaignTooLong, match="the budget holds 20"):
            campaign.run(21)
        assert campaign.figures.nodes == 0
