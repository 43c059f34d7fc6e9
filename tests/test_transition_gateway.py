"""One gateway for every transition (issue 37.1): only the lifecycle's machine builds a Transition,
only apply_event records one, and the table is checked on the way, whichever input it came from.

The source checks read the package's syntax trees (a new route cannot slip in under another
name); the behaviour tests drive the inputs that were once recorded by hand (a person's
replacement, a held node taking a freed budget slot) through the gateway on a real store.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from screener.errors import TransitionRefused
from screener.lifecycle import machine
from screener.lifecycle.apply import SlotLooks, _checked, apply_event, release_held
from screener.lifecycle.machine import (BudgetLook, FleetCounts, HumanCommand, Replaced, decide)
from screener.lifecycle.records import ACTOR_HUMAN, ACTOR_SCREENER, Transition
from screener.lifecycle.table import TRANSITIONS, Trigger, allows, trigger_of
from screener.stores.local import LocalStore
from screener.types import NodeState, Outcome, Reason, Verdict

S = NodeState
ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "screener"
NOW = 1_800_000_000.0

# Where a Transition may be built: the pure decision, and the record's own parser (from_dict).
BUILDERS = {"screener/lifecycle/machine.py", "screener/lifecycle/records.py"}
# Where `.record(` may be called: the lifecycle (its decision's own helper) and the stores.
RECORDERS = ("screener/lifecycle/", "screener/stores/")
STATE_FIELDS = {"from_state", "to_state"}


def gateway_breaches(rel: str, source: str) -> list[str]:
    """Where `source` (the module at `rel`) builds, re-states or records a transition itself."""
    tree = ast.parse(source)
    names = {"Transition"}  # the class's names in this module, aliases included
    modules = set()  # names bound to screener.lifecycle.records
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                if a.name == "Transition":
                    names.add(a.asname or a.name)
                if n.module == "screener.lifecycle" and a.name == "records":
                    modules.add(a.asname or a.name)
                if (n.module == "screener.lifecycle.machine" and a.name == "decide"
                        and not rel.startswith("screener/lifecycle/")):
                    names.add("decide")  # a decision recorded by hand: see below
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "screener.lifecycle.records":
                    modules.add(a.asname or a.name)
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        where = f"{rel}:{n.lineno}"
        builds = ((isinstance(f, ast.Name) and f.id in names - {"decide"})
                  or (isinstance(f, ast.Attribute) and f.attr == "Transition"))
        if builds and rel not in BUILDERS:
            out.append(f"{where}: builds a Transition")
        # dataclasses.replace (or a bare replace) that changes a record's states is a new move
        is_replace = ((isinstance(f, ast.Name) and f.id == "replace")
                      or (isinstance(f, ast.Attribute) and f.attr == "replace"
                          and isinstance(f.value, ast.Name) and f.value.id == "dataclasses"))
        if (is_replace and rel not in BUILDERS
                and STATE_FIELDS & {k.arg for k in n.keywords if k.arg}):
            out.append(f"{where}: replaces a transition's states")
        if (isinstance(f, ast.Attribute) and f.attr == "record"
                and not rel.startswith(RECORDERS)):
            out.append(f"{where}: records a transition past apply_event")
        decides = ((isinstance(f, ast.Name) and f.id == "decide" and "decide" in names)
                   or (isinstance(f, ast.Attribute) and f.attr == "decide"
                       and isinstance(f.value, ast.Name) and f.value.id == "machine"))
        if decides and not rel.startswith("screener/lifecycle/"):
            out.append(f"{where}: decides outside apply_event (its transitions go unrecorded "
                       "or are recorded by hand)")
    return out


def _sources() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_code_builds_or_records_a_transition_past_the_gateway():
    breaches = [b for rel, src in _sources() for b in gateway_breaches(rel, src)]
    assert not breaches, "transitions made past apply_event:\n" + "\n".join(breaches)


@pytest.mark.parametrize("snippet", [
    "from screener.lifecycle.records import Transition\nTransition(node='n', time=0, "
    "from_state=None, to_state=S.REPAIR, reason='x')\n",
    "from screener.lifecycle.records import Transition as T\nT('n', 0, None, S.REPAIR, 'x')\n",
    "from screener.lifecycle import records\nrecords.Transition('n', 0, None, S.REPAIR, 'x')\n",
    "import dataclasses\ndataclasses.replace(t, to_state=S.HEALTHY)\n",
    "store.record(t)\n",
    "from screener.lifecycle.machine import decide\ndecide('n', None, e, now=0)\n",
    "from screener.lifecycle import machine\nmachine.decide('n', None, e, now=0)\n",
])
def test_the_check_catches_each_way_around_it(snippet):
    """The check can fail: each of the old routes, planted in a command, is named."""
    assert gateway_breaches("screener/commands/remediate.py", snippet)


def test_the_check_leaves_the_builders_and_the_stores_alone():
    assert not gateway_breaches("screener/lifecycle/records.py",
                                "Transition('n', 0, None, S.REPAIR, 'x')\n")
    assert not gateway_breaches("screener/stores/local.py", "self.record(t)\n")
    # A replace that keeps the states (the offline spool's note on the reason) is no new move.
    assert not gateway_breaches("screener/stores/kube/store.py",
                                "import dataclasses\ndataclasses.replace(t, reason='r')\n")


def test_the_lifecycle_keeps_no_module_level_mutable_state():
    """The lifecycle is pure: a module-level dict, list or set (other than __all__ and a Mapping
    constant such as the table) is state one caller leaves for the next."""
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    factories = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}
    found = []
    for path in sorted((PACKAGE / "lifecycle").glob("*.py")):
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.Global):
                found.append(f"{path.name}:{n.lineno}: global {', '.join(n.names)}")
        for n in tree.body:
            if isinstance(n, ast.Assign):
                targets, value, note = n.targets, n.value, None
            elif isinstance(n, ast.AnnAssign) and n.value is not None:
                targets, value, note = [n.target], n.value, ast.unparse(n.annotation)
            else:
                continue
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"] or (note or "").startswith("Mapping["):
                continue
            made = (isinstance(value, mutable)
                    or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        and value.func.id in factories))
            if made:
                found.append(f"{path.name}:{n.lineno}: {', '.join(names)}")
    assert not found, f"module-level mutable state in screener/lifecycle: {found}"


# --- the table on the way in --------------------------------------------------------------------

def test_the_gateway_refuses_a_transition_the_table_does_not_list():
    ok = Transition(node="n1", time=NOW, from_state=S.QUARANTINED, to_state=S.REPAIR,
                    reason="replaced", actor=ACTOR_HUMAN)
    assert _checked((ok,)) == (ok,)
    # Only a passing screen makes a node healthy: no person's record of it passes the gateway.
    forged = Transition(node="n1", time=NOW, from_state=S.REPAIR, to_state=S.HEALTHY,
                        reason="looks fine", actor=ACTOR_HUMAN)
    with pytest.raises(AssertionError, match="not in the transition table"):
        _checked((ok, forged))
    auto = Transition(node="n1", time=NOW, from_state=S.HEALTHY, to_state=S.BURNIN, reason="x",
                      actor=ACTOR_SCREENER)
    with pytest.raises(AssertionError):
        _checked((auto,))


def test_allows_reads_every_row_as_it_is():
    assert trigger_of(ACTOR_HUMAN) == Trigger.HUMAN and trigger_of("screener") == Trigger.AUTO
    for (frm, to), who in TRANSITIONS.items():
        for trigger in Trigger:
            assert allows(frm, to, trigger) == (trigger in who)
    assert not allows(S.REPAIR, S.HEALTHY, Trigger.HUMAN)
    assert allows(S.REPAIR, S.REPAIR, Trigger.HUMAN)  # a replacement on file
    assert not allows(S.REPAIR, S.REPAIR, Trigger.AUTO)


def test_a_person_cannot_set_a_node_in_repair_to_repair():
    """The replacement's self-move row is not a person's command: `node set` still says so."""
    with pytest.raises(TransitionRefused, match="already repair"):
        decide("n1", S.REPAIR, HumanCommand(S.REPAIR, "again"), now=NOW)


# --- a person's replacement ---------------------------------------------------------------------

REPLACED = Replaced(reason="SDC: SageMaker HyperPod BatchReplaceClusterNodes accepted instance i-1",
                    evidence={"hyperpod": {"action": "replace", "instance_id": "i-1"}})


@pytest.mark.parametrize("current", [None] + list(NodeState), ids=lambda s: s.value if s else "new")
def test_a_replacement_goes_to_repair_where_the_table_allows_a_person(current):
    if not allows(current, S.REPAIR, Trigger.HUMAN):
        with pytest.raises(TransitionRefused, match="refused"):
            decide("n1", current, REPLACED, now=NOW)
        return
    d = decide("n1", current, REPLACED, now=NOW)
    (t,) = d.transitions
    assert (t.from_state, t.to_state, t.actor, t.code) == (current, S.REPAIR, "human",
                                                           Reason.REPLACED)
    assert t.reason == REPLACED.reason and t.evidence == REPLACED.evidence and not t.failure
    assert t.actions == (machine.Action.REQUEST_REPAIR.value,) == d.actions


def test_a_replacement_needs_a_reason():
    with pytest.raises(TransitionRefused, match="needs a reason"):
        decide("n1", S.QUARANTINED, Replaced(reason="  "), now=NOW)


def test_a_replacement_is_recorded_on_the_state_the_store_holds(tmp_path):
    store = LocalStore(tmp_path / "s.db")
    try:
        apply_event(store, "n1", HumanCommand(S.QUARANTINED, "smoke"), now=NOW)
        d = apply_event(store, "n1", REPLACED, now=NOW + 1)
        assert d.state == S.REPAIR and store.get_state("n1") == S.REPAIR
        again = apply_event(store, "n1", REPLACED, now=NOW + 2)  # replaced once more, in repair
        assert (again.transition.from_state, again.transition.to_state) == (S.REPAIR, S.REPAIR)
        assert [t.code for t in store.history("n1")] == [Reason.MANUAL, Reason.REPLACED,
                                                         Reason.REPLACED]
    finally:
        store.close()


# --- a held node takes a freed slot --------------------------------------------------------------

def _held_history():
    """A healthy node whose confirmed failure found the budget used up: held in suspect."""
    confirmed = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm",
                        evidence={"confirmed": True})
    history = list(decide("n1", None, machine.NodeSeen(), now=NOW - 10).transitions)
    history.append(Transition(node="n1", time=NOW - 5, from_state=S.BURNIN, to_state=S.HEALTHY,
                              reason="passed"))
    held = decide("n1", S.HEALTHY, confirmed, now=NOW, history=history,
                  fleet=FleetCounts(total=10, out_of_service=1))
    assert held.state == S.SUSPECT and held.transition.evidence["held_by_budget"] is True
    return history + list(held.transitions)


def test_a_budget_look_releases_a_held_node_once_a_slot_is_free():
    history = _held_history()
    full = decide("n1", S.SUSPECT, BudgetLook(), now=NOW + 1, history=history,
                  fleet=FleetCounts(total=10, out_of_service=1))
    assert not full.changed and full.state == S.SUSPECT and "still used up" in full.note
    d = decide("n1", S.SUSPECT, BudgetLook(), now=NOW + 2, history=history,
               fleet=FleetCounts(total=10, out_of_service=0))
    (t,) = d.transitions
    assert (t.from_state, t.to_state, t.code, t.actor) == (S.SUSPECT, S.QUARANTINED,
                                                           Reason.BUDGET, "screener")
    assert not t.failure and t.evidence["released_by_budget"] == {
        "held_transition": history[-1].id, "limit": 1, "fleet": 10, "out_of_service": 0}
    assert t.actions == (machine.Action.DEEP_HEALTH_CHECK.value,)
    assert t.rollback == history[-1].rollback


@pytest.mark.parametrize("current", [None] + list(NodeState), ids=lambda s: s.value if s else "new")
def test_a_budget_look_changes_nothing_but_a_held_node(current):
    """Not even a new node starts in burnin on a look: only NodeSeen does that."""
    d = decide("n1", current, BudgetLook(), now=NOW, fleet=FleetCounts(total=10))
    assert not d.changed and d.state == current


def test_slot_looks_space_the_looks_of_the_caller_that_holds_them(tmp_path):
    """release_held keeps no state of its own: two callers' looks do not hold each other back."""
    store = LocalStore(tmp_path / "s.db")
    try:
        apply_event(store, "n1", machine.NodeSeen(), now=NOW)
        looks = SlotLooks(min_interval_s=30.0)
        assert looks.due("n1", NOW) and not looks.due("n1", NOW + 29) and looks.due("n1", NOW + 30)
        assert release_held(store, "n1", None, now=NOW + 31) == (S.BURNIN, None)
        assert release_held(store, "n1", None, now=NOW + 31) == (S.BURNIN, None)  # no limit
        assert release_held(store, "n1", S.HEALTHY, now=NOW + 31) == (S.HEALTHY, None)
    finally:
        store.close()
