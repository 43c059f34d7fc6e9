"""KubeStore: node states on the Kubernetes Node objects themselves (the only importer of kubernetes).

What a transition writes (the names: screener.types; where each thing lives: formats.py):
  * label `screener.io/state=<state>`, and taint `screener.io/state=<state>:NoSchedule` on every
    state but healthy (replacing our previous taint, keeping everyone else's), with the bounded
    summary annotation `screener.io/history` (the last few transitions), in one patch;
  * the full transition in the node's history ConfigMap in the screener namespace;
  * the quarantine budget (budget.py): a slot claimed when the node leaves the service
    (before its node write) and freed when it rejoins; its registration when it is new;
  * condition `GPUHardwareSuspect` (True for suspect/quarantined/repair) through nodes/status;
  * one Event on the Node (Warning for suspect, quarantined and repair), named after the
    transition's id so a replay cannot post it twice.

The work per transition is a bounded number of requests and bytes whatever the fleet's size:
nothing on the per-event path lists nodes. Lists (always paginated, Node lists metadata-only) are
for fleet-wide commands (`node status`, `lemons`), the cross-check, and the budget record's
count, made by one daemon (its lease) when the record is an hour old.

API calls made (the RBAC in manifests/): nodes get/list/patch, nodes/status patch, events create,
pods list; configmaps get/list/create/update/delete in the screener namespace. Writes carry the
resourceVersion that was read, so a concurrent writer makes ours fail with 409 and we read again
and re-apply: nobody's labels, taints or conditions are lost. Every request has a connect and a
read timeout and every call a deadline (calls.py); transient errors (5xx, 429, connection
failures, timeouts) are retried with backoff within it. A transition is one unit: when any of its
writes still fails (the API out of reach, or conflicts that do not settle), it goes to the spool
and is replayed in order before anything newer is written; each write re-checks the current
objects, so a replay completes a partial write (a node patch whose answer was lost, a missing
registration, condition or Event) and never does one twice.

KubeStore is the facade of the Store protocol over its parts, each a module of its own: the API
client (calls.py: timeouts, retries, 409 read-modify-write), what goes on the Node
(node.py: label, taints, condition), the node histories and their migration (history.py),
the quarantine budget (budget.py), the Events (events.py) and the writer that makes one
transition one unit of all of them (write.py). Here: the spool's order (record, replay), the
reads, and the node-level calls the daemon makes besides the protocol.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence

from screener import boundedjson
from screener._optional import require

require("kubernetes", "the Kubernetes store (--store kube, or auto with a kubeconfig or in a pod)")
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from screener.settings.stores import in_pod, kubeconfig_path
from screener.errors import ConfigError
from screener.stores.kube import formats as kf
from screener.stores.common import summary_row
from screener.stores.kube.budget import FLEET_SHARDS, BudgetView, KubeBudget, decided_limit
# Re-exported: the names callers and tests import from here.
from screener.stores.kube.calls import (MERGE_PATCH, META_ACCEPT, TRANSIENT_STATUS,  # noqa: F401
                                       ApiCaller, KubeApiError, KubeTimeouts, NodeNotFound,
                                       RetryPolicy, TransientKubeError)
from screener.stores.kube.config import check_kubeconfig, check_loaded
from screener.stores.kube.events import NodeEvents
from screener.stores.kube.formats import EVIDENCE_BYTES, shrink_evidence  # noqa: F401 (re-exported)
from screener.stores.kube.history import NodeHistories
from screener.stores.kube.quorum import KubeQuorum
from screener.stores.kube.node import (GPU_RESOURCE, WARNING_STATES,  # noqa: F401 (re-exported)
                                      annotation, condition_status, gpus_requested, reason_patch,
                                      screening_patch, state_name,
                                      state_of)
from screener.stores.kube.write import Superseded, TransitionWriter
from screener.stores.intents import IntentJournal
from screener.lifecycle.records import (ACTOR_SCREENER, BUDGET_STATES, BudgetConflict,
                                        StaleTransition, Transition, json_safe)
from screener.stores.paths import default_state_dir
from screener.stores.spool import Spool
from screener.types import ANNOTATION_HISTORY, ANNOTATION_VERDICT, LABEL_STATE, NodeState, node_name

if TYPE_CHECKING:
    from screener.stores.slots import KubeSlots

# The name it had as one module (screener/stores/kube.py): log queries filter on it.
log = logging.getLogger("screener.stores.kube")

DEFAULT_NAMESPACE = "screener-system"


class KubeStore:
    """A Store on Node objects. Pass an ApiClient (tests point one at a loopback server)."""

    def __init__(self, api_client: Any, *, spool: Optional[Spool] = None,
                 event_namespace: str = "default", namespace: Optional[str] = None,
                 history_limit: int = kf.HISTORY_KEEP, history_bytes: int = kf.HISTORY_BYTES,
                 page_size: int = 500, recount_s: float = 3600.0, claim_grace_s: float = 600.0,
                 retry: RetryPolicy = RetryPolicy(), timeouts: KubeTimeouts = KubeTimeouts(),
                 fleet_shards: int = FLEET_SHARDS,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random, component: str = "screener",
                 instance: Optional[str] = None,
                 intents: Optional[IntentJournal] = None) -> None:
        """namespace: where the history ConfigMaps and the budget live ($POD_NAMESPACE, else
        screener-system). history_limit/history_bytes bound a node's history ConfigMap.
        page_size: items per page of a list. recount_s: how old the budget record's fleet count
        may get before one daemon counts it again (one paginated list of Node metadata).
        claim_grace_s: how long a count keeps a budget slot whose node does not show the state
        yet (the claimer is between its two writes). timeouts: of every request and call (the
        daemon's `kube_timeouts` table). fleet_shards: how many objects registrations spread
        over (every daemon of a fleet must use the same number). intents: the journal of
        transitions in flight (intents.py); default: `intents/` next to the spool's file (none
        with a spool in memory)."""
        self.api = kubernetes.client.CoreV1Api(api_client)
        self.spool = spool if spool is not None else Spool(":memory:")
        if intents is None:
            where = self.spool.path
            intents = IntentJournal(None if where == ":memory:" else Path(where).parent / "intents")
        self.intents = intents
        self.namespace = namespace or os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE
        self.clock = clock
        self.instance = instance or node_name()
        # False in the daemon's observe mode (observe_only): no screener taint is ever added.
        self.write_taints = True
        # True in the daemon (decide_offline): with the API out of reach, decide and spool.
        self.offline = False
        self._lock = threading.RLock()
        self.calls = ApiCaller(self.api, self.namespace, api_exception=ApiException, retry=retry,
                               timeouts=timeouts, sleep=sleep, rng=rng, page_size=page_size)
        self.budget = KubeBudget(self.calls, instance=self.instance, clock=clock, sleep=sleep,
                                 rng=rng, conflict_attempts=retry.conflict_attempts,
                                 recount_s=recount_s, claim_grace_s=claim_grace_s,
                                 shards=fleet_shards,
                                 register_ahead_s=timeouts.call_s + 60.0)
        self.histories = NodeHistories(self.calls, self.spool, keep=history_limit,
                                       max_bytes=history_bytes,
                                       conflict_attempts=retry.conflict_attempts)
        events = NodeEvents(self.calls, namespace=event_namespace, component=component,
                            instance=self.instance, clock=clock)
        self.writer = TransitionWriter(self.calls, self.histories, self.budget, events, clock=clock)
        self.quorum = KubeQuorum(self.calls, self.set_annotations)

    @classmethod
    def from_config(cls, *, kubeconfig: Optional[str] = None, context: Optional[str] = None,
                    spool_path: Optional[os.PathLike[str] | str] = None, **kwargs: Any) -> "KubeStore":
        """Load configuration as kubectl does (screener.settings.stores.kubeconfig_path):
        --kubeconfig, else $KUBECONFIG's files, else ~/.kube/config, else in-cluster inside a
        pod; `context` picks a kubeconfig context. Keyword arguments go to the constructor."""
        cfg = kubernetes.client.Configuration()
        path = kubeconfig_path(str(kubeconfig) if kubeconfig else None)
        in_cluster = path is None and in_pod()
        where = path or ("in-cluster service account" if in_cluster else "no kubeconfig")
        try:
            if path:
                for one in path.split(os.pathsep):
                    check_kubeconfig(one)
                # The path, not the loader's default: that one is read from $KUBECONFIG once,
                # when kubernetes is imported.
                kubernetes.config.load_kube_config(config_file=path, context=context,
                                                   client_configuration=cfg)
            elif in_cluster and not context:
                kubernetes.config.load_incluster_config(client_configuration=cfg)
            else:
                raise ConfigError(
                    f"no kubeconfig has context {context!r} (in-cluster configuration has none)"
                    if in_cluster else "no Kubernetes configuration: no --kubeconfig, $KUBECONFIG "
                    "names no file, no ~/.kube/config and not in a pod")
            check_loaded(cfg, where)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the loader parses hostile text; any failure is
            # the file's: a garbage kubeconfig raises AttributeError, TypeError, KeyError,
            # yaml errors, RecursionError... all one line and exit 2, never a traceback.
            text = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"{where}: cannot load Kubernetes configuration: {text}") from e
        # One layer of retries, ours, within the call's deadline: urllib3's own would retry a
        # timed-out GET three more times inside one of our attempts.
        cfg.retries = False
        spool = Spool(spool_path if spool_path is not None else default_state_dir() / "spool.db")
        return cls(kubernetes.client.ApiClient(cfg), spool=spool, **kwargs)

    # --- Store protocol ---------------------------------------------------------------------

    def one_pass(self) -> ContextManager[None]:
        """A daemon pass: each object it needs is read once (calls.ApiCaller.one_pass)."""
        return self.calls.one_pass()

    def get_state(self, node: str) -> Optional[NodeState]:
        pending = self.spool.entries(node)
        if pending:
            return pending[-1][1].to_state
        return state_of(self.calls.read_node(node))

    def record(self, transition: Transition) -> None:
        """Write now, or spool (after retries) and write later in order. Never drops a transition."""
        with self._lock, self.intents.write([transition]) as intent:
            self._record(transition)
            intent.done()

    def _record(self, transition: Transition, node_obj: Optional[dict[str, Any]] = None,
                cm: Any = ..., view: Optional[BudgetView] = None) -> bool:
        """record(), reusing objects just read; True when written now, False when spooled."""
        with self._lock:
            if len(self.spool):
                self.spool.append(transition)
                self.replay()
                return False
            try:
                self._write(transition, check_from=True, node_obj=node_obj, cm=cm, view=view)
                return True
            except TransientKubeError as e:
                self.spool.append(transition)
                log.warning("transition of %s to %s spooled (%d waiting): %s", transition.node,
                            transition.to_state.value, len(self.spool), e)
                return False

    def _write(self, t: Transition, *, check_from: bool, node_obj: Optional[dict[str, Any]] = None,
               cm: Any = ..., view: Optional[BudgetView] = None) -> None:
        """One transition, as one unit (write.py), with the taints this store's mode allows."""
        self.writer.write(t, check_from=check_from, write_taints=self.write_taints,
                          node_obj=node_obj, cm=cm, view=view)
        self.spool.remember(t.node, t.to_state.value)

    def decide_offline(self) -> None:
        """The daemon's mode (issue 36.4): while the API server is out of reach, a decision is
        made on what this store knows (the node's spooled or last known state) and spooled, so
        an alarm or a finding is durable and its file or kernel-log position can move on. A
        failure decided so cannot claim a budget slot: it is held in suspect (tainted, no new
        work) and takes a slot through the budget's release once the API answers
        (lifecycle.apply.release_held), so the budget stays exact. Other callers (`node set`,
        burn-in) keep failing: their spool has no daemon to replay it."""
        self.offline = True

    def wind_down(self, seconds: float) -> None:
        """No API call, in flight or to come, runs past `seconds` from now (SIGTERM)."""
        self.calls.wind_down(seconds)

    def replay(self) -> int:
        """Write spooled transitions oldest first; stop at the first that still cannot be written.

        Returns how many were written. Call it periodically (the daemon does); record() also does.
        """
        done = 0
        superseded: set[str] = set()
        with self._lock:
            for seq, t in self.spool.entries():
                if t.node in superseded and not t.failure:
                    # Decided after the superseded one, on the state it led to: stale as well.
                    log.error("dropping spooled transition %s of %s: an earlier one of the node was "
                              "superseded by a person's decision", t.id, t.node)
                    self.spool.remove(seq)
                    continue
                try:
                    self._write(t, check_from=False)
                except TransientKubeError as e:
                    log.info("replay stopped, API still unavailable: %s", e)
                    break
                except (NodeNotFound, Superseded) as e:
                    # The node was deleted meanwhile, or a person decided about it after this was
                    # spooled: nothing to write it onto, or writing it would undo the person's
                    # decision; and keeping it would block every later transition behind it.
                    log.error("dropping spooled transition %s of %s: %s", t.id, t.node, e)
                    self.spool.remove(seq)
                    if isinstance(e, Superseded):
                        superseded.add(t.node)
                    continue
                # Other errors (RBAC, validation) propagate and keep the entry: a person must fix them.
                self.spool.remove(seq)
                done += 1
        if done:
            log.info("replayed %d spooled transition(s)", done)
        return done

    def pending(self) -> int:
        """How many transitions wait in the spool."""
        return len(self.spool)

    def _unwritten(self, node: str) -> list[Transition]:
        """The node's transitions decided and not known written: an unfinished intent's (its
        writer died, and the API has been out of reach since) and the spool's, oldest first."""
        spooled = [t for _, t in self.spool.entries(node)]
        ids = {t.id for t in spooled}
        return sorted(spooled + [t for t in self.intents.pending(node) if t.id not in ids],
                      key=lambda t: t.time)

    def finish_intents(self) -> int:
        """Finish the transitions that a screener process which died (kill -9, OOM, power) left
        half-written: every intent on file whose writer is gone (intents.py), oldest first.

        The daemon calls this at its start and at the start of every pass, before anything reads
        the node. A transition whose Node write landed is completed (history entry, budget,
        condition, Event: each written only where missing); one whose Node write did not land is
        written now if the node is still in the state it was decided on (its budget slot claimed
        first, under the limit it was decided under), and otherwise dropped: it was decided on a
        state another writer has changed, and the input it came from (an alarm file, a finding)
        was not marked done, so it is decided again. Either way the node ends with at most one
        budget slot. Stops at the first the API cannot take yet (TransientKubeError), to try again
        on the next pass; returns how many were finished or dropped."""
        handled = 0
        with self._lock:
            for intent in self.intents.unfinished():
                with intent:
                    try:
                        for t in intent.transitions:
                            self._finish(t)
                    except TransientKubeError as e:
                        log.info("unfinished transition %s of %s waits: the API is out of reach "
                                 "(%s)", intent.key, intent.transitions[0].node, e)
                        break
                    except NodeNotFound as e:
                        log.error("dropping unfinished transition %s: %s", intent.key, e)
                    intent.done()
                    handled += 1
        if handled:
            log.warning("finished %d transition(s) that a stopped screener left half-written",
                        handled, extra={"event": "intents_finished", "count": handled})
        return handled

    def _finish(self, t: Transition) -> None:
        """One transition of an unfinished intent (see finish_intents)."""
        obj = self.calls.read_node(t.node)
        cm = self.histories.configmap(t.node)
        on_node, _ = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), t.node)
        written = (any(e.get("id") == t.id for e in on_node)
                   or any(e["id"] == t.id for e in kf.history_entries(cm)))
        stored = state_of(obj)
        if written:
            self._write(t, check_from=False, node_obj=copy.deepcopy(obj), cm=cm)
            self.budget.settle(t.node, state_of(self.calls.read_node(t.node)))
            log.warning("finished transition %s of %s (%s -> %s), left half-written by a stopped "
                        "screener", t.id, t.node, state_name(t.from_state), t.to_state.value,
                        extra={"event": "intent_finished", "transition": t.id})
            return
        if stored != t.from_state:
            self.budget.settle(t.node, stored)
            log.warning("dropping unfinished transition %s of %s (%s -> %s): nothing of it was "
                        "written and the node is %s now; its input is decided again", t.id,
                        t.node, state_name(t.from_state), t.to_state.value,
                        state_name(stored), extra={"event": "intent_dropped",
                                                       "transition": t.id})
            return
        view = self.budget.view()
        if t.to_state in BUDGET_STATES and t.from_state not in BUDGET_STATES:
            own = self.budget.slots_of(t.node)  # a claim made before the process died
            view.claims.update({c.index: c for c in own})
            if not own:
                limit = decided_limit(t, view) if t.actor == ACTOR_SCREENER else None
                try:
                    view = self.budget.claim(view, t.node, t.to_state, limit)
                except BudgetConflict as e:
                    log.warning("dropping unfinished transition %s of %s: nothing of it was "
                                "written and %s; its input is decided again", t.id, t.node, e,
                                extra={"event": "intent_dropped", "transition": t.id})
                    return
        try:
            self._record(t, node_obj=copy.deepcopy(obj), cm=cm, view=view)
        except StaleTransition:
            self.budget.settle(t.node, state_of(self.calls.read_node(t.node)))
            raise
        log.warning("finished transition %s of %s (%s -> %s), decided by a stopped screener "
                    "before its first write", t.id, t.node, state_name(t.from_state),
                    t.to_state.value, extra={"event": "intent_finished", "transition": t.id})

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        try:
            obj = self.calls.read_node(node)
            return self.histories.of_node(node, obj, self.histories.configmap(node), since)
        except TransientKubeError:
            if not self.offline:
                raise
            # Out of reach in the daemon: what this store has decided and not written yet.
            return [t for t in self._unwritten(node) if since is None or t.time >= since]

    def all_states(self) -> dict[str, NodeState]:
        """Every node with a screener state: one paginated, label-selected list of Node metadata."""
        out: dict[str, NodeState] = {}
        for obj in self.calls.node_meta(LABEL_STATE):
            state = state_of(obj)
            if state is not None:
                out[obj["metadata"]["name"]] = state
        for _, t in self.spool.entries():
            out[t.node] = t.to_state
        return dict(sorted(out.items()))

    def summaries(self) -> list[dict[str, Any]]:
        """State and last transition of every node, from one paginated list of Node metadata."""
        rows: dict[str, dict[str, Any]] = {}
        for obj in self.calls.node_meta(LABEL_STATE):
            name = obj["metadata"]["name"]
            state = state_of(obj)
            if state is None:
                continue
            entries, _ = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), name)
            rows[name] = summary_row(name, state, entries[-1] if entries else None,
                                     _parsed(annotation(obj, ANNOTATION_VERDICT)))
        for _, t in self.spool.entries():
            rows[t.node] = summary_row(t.node, t.to_state, t.to_dict(),
                                       verdict=(rows.get(t.node) or {}).get("last_screen"))
        return [rows[n] for n in sorted(rows)]

    def failures(self, since: float) -> list[Transition]:
        """Failures of every node at or after `since` (NodeHistories.failures: linear in the
        fleet, for `lemons`)."""
        return self.histories.failures(since)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failures at or after `since` blaming one of `serials`, without reading the fleet."""
        return self.histories.failures_for(serials, since)

    @contextmanager
    def begin(self, node: str) -> Iterator["KubeTxn"]:
        """One read-decide-write of `node` against the budget (see NodeTxn); a transition that a
        stopped screener left half-written is finished first (finish_intents)."""
        with self._lock:
            if len(self.intents):
                try:
                    self.finish_intents()
                except KubeApiError as e:  # a person must fix it; the decision goes on
                    log.error("cannot finish a half-written transition: %s", e)
            try:
                txn: Any = KubeTxn(self, node)
            except TransientKubeError as e:
                if not self.offline:
                    raise
                txn = OfflineTxn(self, node, e)
            yield txn

    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        self.set_annotations(node, {ANNOTATION_VERDICT: json.dumps(json_safe(dict(verdict)),
                                                                   sort_keys=True)})

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        raw = annotation(self.calls.read_node(node), ANNOTATION_VERDICT)
        if not raw:
            return None
        try:
            data = boundedjson.strict(raw)
        except ValueError:
            data = None
        # Anyone who may edit the Node may write it: what is not an object is unparsable.
        return data if isinstance(data, dict) else {"unparsable": raw[:200]}

    def slots(self, pool: str, capacity: int, *, ttl: float,
              clock: Callable[[], float]) -> "KubeSlots":
        """A fleet-wide slot pool (stores/slots.py) as places of the fleet semaphore in this
        store's namespace: at most `capacity` nodes hold one at once, a claim older than `ttl`
        may be taken over."""
        from screener.stores.slots import KubeSlots

        return KubeSlots(self.calls, pool, capacity, ttl=ttl, clock=clock)

    def close(self) -> None:
        self.spool.close()
        self.api.api_client.close()

    # --- the quarantine budget (budget.py) ----------------------------------------------

    def budget_view(self) -> BudgetView:
        """The budget as it stands (fleet, out, counted): one list; counted again when stale."""
        return self.budget.view()

    def _settle_slots(self, node: str) -> None:
        """After a claim whose node write was refused: the node keeps one slot if its label says
        it is out (whoever's claim it was), none otherwise (budget.KubeBudget.settle)."""
        try:
            state = state_of(self.calls.read_node(node))
        except NodeNotFound:
            state = None
        self.budget.settle(node, state)

    # --- what the daemon needs besides the protocol -----------------------------------------

    def get_node(self, node: str) -> dict[str, Any]:
        """The Node object as plain JSON (labels, annotations, taints, providerID, conditions)."""
        return self.calls.read_node(node)

    def node_annotations(self, node: str) -> dict[str, str]:
        return dict(self.calls.read_node(node)["metadata"].get("annotations") or {})

    def annotations_by_node(self, key: str, label_selector: str = "") -> dict[str, str]:
        """The value of annotation `key` on every node that has it (e.g. peers' KAT digests)."""
        out = {}
        for obj in self.calls.node_meta(label_selector):
            value = (obj["metadata"].get("annotations") or {}).get(key)
            if value is not None:
                out[obj["metadata"]["name"]] = value
        return out

    def set_annotations(self, node: str, values: Mapping[str, Optional[str]]) -> None:
        """Set (or, with None, remove) our annotations; a merge patch leaves all others alone."""
        if self.calls.patch_node(node, {"metadata": {"annotations": dict(values)}}) is None:
            raise KubeApiError(f"node {node}: unexpected conflict setting annotations", 409)

    # --- the fleet quorum (quorum.py) ----------------------------------------------------

    def publish_candidates(self, node: str,
                           candidates: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
        """The results the node's devices reproduced, for other nodes' quorums."""
        self.quorum.publish_candidates(node, candidates)

    def fleet_candidates(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """Every node's published candidates (one paginated list of Node metadata)."""
        return self.quorum.candidates()

    def promote_golden(self, phash: str, job: str, text: str) -> Optional[str]:
        """Store a golden promoted from a quorum (add-only): None when stored, else the record
        already there."""
        return self.quorum.promote(phash, job, text)

    def promoted_goldens(self) -> dict[str, dict[str, str]]:
        """Platform hash -> job -> record text of the promoted goldens (one list)."""
        return self.quorum.promoted()

    def note_condition(self, node: str, reason: str, message: str, *,
                       only_if: Optional[str] = None) -> None:
        """Give the node's GPUHardwareSuspect condition a reason without a transition (what a
        person sees in `kubectl describe node`): its status stays. only_if: only in place of
        this reason."""
        self.calls.update_node(node, lambda o: reason_patch(o, reason, message, self.clock(),
                                                            only_if=only_if), status=True)

    def observe_only(self) -> None:
        """From now on add no taint of ours (the daemon's observe mode, issue 24.2): transitions
        still write the label, annotations, history, condition and Event, and a state taint left
        from an enforcing run is removed, so the taints never disagree with the mode."""
        self.write_taints = False

    def set_screening_taint(self, node: str, on: bool) -> None:
        """Add or remove `screener.io/screening=true:NoSchedule` (only during an idle-time screen;
        in observe mode only ever removed)."""
        on = on and self.write_taints
        self.calls.update_node(node, lambda obj: screening_patch(obj, on))

    def gpu_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods on the node that request GPUs and have not finished: name, namespace, phase, gpus."""
        data = self.calls.call(f"list pods on {node}", self.api.list_pod_for_all_namespaces,
                               field_selector=f"spec.nodeName={node}")
        out = []
        for pod in (data or {}).get("items") or []:
            phase = (pod.get("status") or {}).get("phase") or ""
            if phase in ("Succeeded", "Failed"):
                continue
            gpus = gpus_requested(pod.get("spec") or {})
            if gpus:
                out.append({"name": pod["metadata"]["name"],
                            "namespace": pod["metadata"].get("namespace", ""), "phase": phase,
                            "gpus": gpus})
        return out


class KubeTxn:
    """The NodeTxn of KubeStore: the node, its history and the budget, read once.

    The budget holds exactly however many decide at once: a transition that takes the node out of
    service automatically is written only after it has claimed a free slot below the limit it was
    decided under (budget.py); when none is left, BudgetConflict makes apply_event decide
    again on fresh counts (the node is then held in suspect, tainted at once).
    """

    def __init__(self, store: KubeStore, node: str) -> None:
        self._store, self.node = store, node
        self._obj = store.calls.read_node(node)
        self._cm = store.histories.configmap(node)
        self._view = store.budget.view()
        pending = store.spool.entries(node)
        labelled = state_of(self._obj)
        store.spool.remember(node, labelled.value if labelled is not None else None)
        self.state: Optional[NodeState] = pending[-1][1].to_state if pending else labelled
        self.history = store.histories.of_node(node, self._obj, self._cm)
        self.fleet_total = self._view.fleet + (0 if labelled is not None or pending else 1)
        self.out_of_service = self._view.others_out(node)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        return self._store.failures_for(serials, since)

    def commit(self, transitions: Sequence[Transition]) -> None:
        store = self._store
        if not transitions:
            # A node still carrying the old long history annotation moves it off the Node the
            # first time its daemon looks (at start-up: rolling out this version migrates the
            # fleet, one node per daemon), so the per-GPU lookup finds its failures too.
            on_node, legacy = kf.parse_node_history(annotation(self._obj, ANNOTATION_HISTORY),
                                                    self.node)
            if legacy and on_node:
                store.histories.migrate(self.node, on_node, self._cm)
            return
        for t in transitions:
            if t.node != self.node:
                raise ValueError(f"a decision about {self.node} cannot record a transition of {t.node}")
        # Durable before the first write (intents.py): a process killed from here on leaves a
        # transition the next pass finishes, never half of one.
        with store.intents.write(transitions) as intent:
            first = True
            for t in transitions:
                claimed = False
                try:
                    if (t.to_state in BUDGET_STATES and t.from_state not in BUDGET_STATES
                            and not self._view.claims_of(self.node)):
                        # An automatic decision claims below the limit it was made under; a
                        # person's is not limited by the budget, but counts for others before the
                        # node leaves service.
                        limit = decided_limit(t, self._view) if t.actor == ACTOR_SCREENER else None
                        self._view = store.budget.claim(self._view, self.node, t.to_state, limit)
                        claimed = True
                    if t.from_state is None and not len(store.spool):
                        # Registered before the Node write: no count of the fleet, however it
                        # interleaves, sees the node's label without its registration.
                        store.budget.register(self._view, self.node)
                    store._record(t, node_obj=copy.deepcopy(self._obj) if first else None,
                                  cm=self._cm if first else ..., view=self._view)
                except StaleTransition:
                    if claimed:
                        # Another writer moved the node first (a second daemon on it): the slot
                        # claimed for this transition goes unless it is the node's only one.
                        store._settle_slots(self.node)
                    intent.done()
                    raise
                except BudgetConflict:
                    intent.done()  # nothing of this transition was written: decided again
                    raise
                first = False
            intent.done()


class OfflineTxn:
    """The NodeTxn of a KubeStore in the daemon's offline mode (decide_offline) while the API
    server is out of reach: the node's state is the last spooled one, else the last one this
    store read or wrote (the spool remembers it across restarts); a node it never saw is not
    decided (the read's error stands, and the alarm waits). The history is what the spool holds. The budget cannot be claimed, so every automatic move
    out of service is held in suspect (the lifecycle's own budget path) until a slot is claimed
    online. Everything decided goes to the spool; the replay writes it in order."""

    def __init__(self, store: KubeStore, node: str, cause: TransientKubeError) -> None:
        self._store, self.node, self.cause = store, node, cause
        pending = store._unwritten(node)
        known = store.spool.known(node)
        self.state: Optional[NodeState] = (pending[-1].to_state if pending
                                           else NodeState(known) if known else None)
        if self.state is None:
            # Never seen by this store (a fresh state disk): a guess could put a serving node
            # in burnin, or undo its adoption. It waits for the API, as before.
            raise cause
        self.history = pending
        # No slot can be claimed: counts that hold every automatic quarantine in suspect.
        self.fleet_total = 1
        self.out_of_service = 1

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        return [t for t in self.history if t.failure and t.time >= since
                and set(t.gpu_serials) & set(serials)]

    def commit(self, transitions: Sequence[Transition]) -> None:
        for t in transitions:
            if t.node != self.node:
                raise ValueError(f"a decision about {self.node} cannot record a transition of {t.node}")
            if t.evidence.get("budget") is not None:
                t = dataclasses.replace(
                    t, reason=(f"{t.reason} (decided while the Kubernetes API was out of reach: "
                               "the budget is claimed once it answers)")[:1024],
                    evidence={**t.evidence, "budget": {"offline": str(self.cause)[:300]}})
            self._store.spool.append(t)
            log.warning("transition of %s to %s decided while the API is out of reach, spooled "
                        "(%d waiting): %s", t.node, t.to_state.value, len(self._store.spool),
                        self.cause)


def _parsed(raw: Optional[str]) -> Any:
    """An annotation's JSON, or None when it is absent or does not parse."""
    if not raw:
        return None
    try:
        return boundedjson.strict(raw)
    except ValueError:
        return None
