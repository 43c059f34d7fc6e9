"""Calling the Kubernetes API for KubeStore: timeouts, retries, 409 read-modify-write, and the
errors a caller sees.

Every request carries a connect and a read timeout, and every logical call (its retries included)
ends within `KubeTimeouts.call_s` of total time, whatever the server does: each attempt's timeouts
are cut to the time the call has left, and a watchdog shuts down the call's sockets at its
deadline, so a server that drips its answer a byte at a time cannot stretch it (a read timeout
alone is per recv; deadline.py says why nothing less bounds total time). An API server that accepts
connections and never answers (black-holed, overloaded, a half-dead load balancer) or answers too
slowly costs a bounded wait, after which the caller spools what it was writing and the daemon's
tick goes on. `wind_down(s)` caps every call, those in flight included, to s seconds from now: the
daemon's SIGTERM, so the pod ends within its grace period. After a call ran out of time the API is
taken as unreachable for `unreachable_s`: calls in that window fail at once instead of each waiting
its own timeout, so one tick does not spend minutes on a dead server. Refused and reset connections
fail fast by themselves and do not open that window (it would hold back the first pass after the
server is back); but within a daemon pass, once a call has had no answer through all its retries,
each later call of the pass tries once, without the backoff: a closed port cost a pass `call_s` per
call (45 s against a real server, issue 36.4), now about one `call_s`. The next pass retries in
full.

Within a daemon pass (`one_pass`) an object is read once: a Node or a ConfigMap read, or written,
in the pass is answered from what the pass last saw of it, until a write to it fails (409: someone
else changed it; 404: it is gone), which drops it so the next read asks the server. That is the
consistency every decision already lives with: each write carries the resourceVersion it was
decided on as precondition, so a copy that went stale in the pass costs one conflict and a fresh
read, never a lost change. Lists are not kept (the budget's is a cache read already, and a claim
that lost a race must look again: at the slots' names only, `cm_names`). Outside a pass, and on
other threads, every read asks the server.

Transient answers (5xx, 429, connection failures, timeouts) are retried with exponential backoff
and jitter (RetryPolicy; sleep and randomness injectable); 4xx answers are the caller's business,
except 409 on a Node write: `update_node` reads the Node again and re-applies its change, so a
concurrent writer's labels, taints and conditions are never lost. The
kubernetes client itself is imported by kube.py only (one importer per vendor client): its
ApiException class is passed in.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional

import urllib3

from screener.errors import BadInputError, ConfigError, ExternalServiceError
from screener.stores.kube import deadline as kubedeadline
# The tables live in settings; re-exported, as they were defined here once.
from screener.settings.stores import KubeTimeouts, RetryPolicy

log = logging.getLogger("screener.stores.kube")

TRANSIENT_STATUS = frozenset({0, 429, 500, 502, 503, 504})
# Ask for PartialObjectMetadataList: names, labels and annotations, not the Nodes' status.
META_ACCEPT = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io,application/json"
# Ask for a Table without objects: each object's name and printed columns, nothing else.
TABLE_ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
MERGE_PATCH = "application/merge-patch+json"


class KubeApiError(ExternalServiceError):
    """The Kubernetes API failed or refused a request (after retries, for transient errors)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class TransientKubeError(KubeApiError):
    """The API stayed unreachable, timed out, or kept answering 5xx/429 through every retry; or a
    write kept conflicting. Whatever was being written is spooled and written later."""


class NodeNotFound(BadInputError):
    """No Node of that name exists in the cluster."""


class ApiCaller:
    """One store's way to the API: a call with timeouts and retries, lists by page, ConfigMaps."""

    def __init__(self, api: Any, namespace: str, *, api_exception: type[Any],
                 retry: RetryPolicy, timeouts: KubeTimeouts, sleep: Callable[[float], None],
                 rng: Callable[[], float], page_size: int) -> None:
        """api: a kubernetes CoreV1Api; api_exception: the client's ApiException class."""
        self.api, self.namespace, self.api_exception = api, namespace, api_exception
        self.retry, self.timeouts = retry, timeouts
        self.sleep, self.rng, self.page_size = sleep, rng, page_size
        self._unreachable_until = 0.0  # time.monotonic(): a timed-out call opened the window
        self._guard = threading.Lock()
        self._deadlines = kubedeadline.Owner()
        # The client's connections enlist with the call on their thread, so the watchdog can end
        # a call at its deadline however the server answers (deadline.py).
        client = getattr(getattr(api, "api_client", None), "rest_client", None)
        self.watched = kubedeadline.install(getattr(client, "pool_manager", None))
        self._pass = threading.local()  # the open pass's copies, on the thread that opened it

    @contextmanager
    def one_pass(self) -> Iterator[None]:
        """Within it, on this thread, each Node and ConfigMap is read from the server once (the
        module docstring's rule); nested passes share the outermost one's copies."""
        outer = getattr(self._pass, "seen", None)
        if outer is None:
            self._pass.seen = {}
            self._pass.unanswered = False  # a call of this pass had no answer (see call)
        try:
            yield
        finally:
            if outer is None:
                self._pass.seen = None
                self._pass.unanswered = False

    def _seen(self, key: tuple[str, str]) -> tuple[bool, Any]:
        seen = getattr(self._pass, "seen", None)
        if seen is None or key not in seen:
            return False, None
        return True, copy.deepcopy(seen[key])

    def _saw(self, key: tuple[str, str], obj: Any) -> None:
        """What the server last said of `key` (None: absent); `...`: forget it, ask next time."""
        seen = getattr(self._pass, "seen", None)
        if seen is None:
            return
        if obj is ...:
            seen.pop(key, None)
        else:
            seen[key] = copy.deepcopy(obj)

    def wind_down(self, seconds: float) -> None:
        """No call, in flight or to come, runs past `seconds` from now (the daemon's SIGTERM)."""
        self._deadlines.cap(seconds)

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the API and return the parsed JSON body; retry transient errors with backoff,
        all within timeouts.call_s of total time (and the wind-down cap, when one is set)."""
        self._fail_fast(what)
        kwargs["_preload_content"] = False
        started = time.monotonic()
        deadline = started + self.timeouts.call_s
        last: Optional[BaseException] = None
        timed_out = False
        attempt = 0
        in_pass = getattr(self._pass, "seen", None) is not None
        # Once a call of this pass had no answer at all, the rest of the pass tries each call once.
        attempts = 1 if in_pass and self._pass.unanswered else self.retry.attempts
        for attempt in range(attempts):
            if attempt:
                delay = self.retry.delay(attempt - 1, self.rng)
                if self._deadlines.left(deadline) - delay <= 0:
                    break  # no time left for another try
                self.sleep(delay)
            left = self._deadlines.left(deadline)
            if left <= 0:
                timed_out = timed_out or last is None
                break
            # Each attempt's timeouts within what the call has left; the watchdog ends it there.
            kwargs["_request_timeout"] = (min(self.timeouts.connect_s, left),
                                          min(self.timeouts.read_s, left))
            watch = kubedeadline.begin(self._deadlines, deadline)
            try:
                try:
                    data = fn(*args, **kwargs).data
                finally:
                    fired = kubedeadline.end(watch)
                if fired:  # an answer cut short by the deadline is no answer, whatever came
                    raise TimeoutError(f"no whole answer within the call's "
                                       f"{self.timeouts.call_s:g} s")
                if in_pass:
                    self._pass.unanswered = False  # the server answers again
                return json.loads(data) if data else None
            except self.api_exception as e:
                if e.status not in TRANSIENT_STATUS or watch.fired:
                    if watch.fired:
                        last, timed_out = e, True
                        break
                    if in_pass:
                        self._pass.unanswered = False  # an answer, if not the one wanted
                    raise KubeApiError(f"{what}: Kubernetes API answered {e.status} {e.reason}: "
                                       f"{_message(e)}", e.status) from e
                last = e
                log.info("%s: transient API error %s (attempt %d)", what, e.status, attempt + 1)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                last = e
                if watch.fired:
                    timed_out = True
                    log.info("%s: no answer within the call's deadline (attempt %d)", what,
                             attempt + 1)
                    break
                log.info("%s: API unreachable: %s (attempt %d)", what, e, attempt + 1)
            if self._deadlines.left(deadline) <= 0:
                break
        timed_out = timed_out or _timed_out(last)
        if in_pass and last is not None:
            # refused, reset or timed out: no answer at all; a 5xx or 429 is an answer
            self._pass.unanswered = not isinstance(last, self.api_exception)
        if timed_out and self.timeouts.unreachable_s > 0:
            with self._guard:
                self._unreachable_until = time.monotonic() + self.timeouts.unreachable_s
        if last is None:
            brief = "not sent: the screener is stopping" if self._deadlines.left(deadline) <= 0 \
                else "no attempt made"
        elif timed_out and not isinstance(last, self.api_exception):
            brief = f"timed out: {last}"
        else:
            brief = (f"{last.status} {last.reason}: {_message(last)}"
                     if isinstance(last, self.api_exception) else str(last))
        raise TransientKubeError(f"{what}: Kubernetes API unavailable after {attempt + 1} "
                                 f"attempts: {brief} ({time.monotonic() - started:.1f} s)") from last

    def _fail_fast(self, what: str) -> None:
        with self._guard:
            left = self._unreachable_until - time.monotonic()
        if left > 0:
            raise TransientKubeError(f"{what}: not sent: the Kubernetes API did not answer in "
                                     f"time; trying again in {left:.0f} s")

    def pages(self, what: str, fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Items of a list, `page_size` at a time (limit/continue). With resource_version="0" the
        API server answers from its cache, where it may ignore limit and send everything."""
        token: Optional[str] = None
        while True:
            extra = {"_continue": token} if token else {}
            data = self.call(what, fn, *args, limit=self.page_size, **kwargs, **extra) or {}
            yield from data.get("items") or []
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                return

    def node_meta(self, label_selector: str = "") -> Iterator[dict[str, Any]]:
        """Nodes as PartialObjectMetadata (name, labels, annotations), paginated, consistent."""
        client = self.api.api_client
        token: Optional[str] = None
        while True:
            query: list[tuple[str, Any]] = [("limit", self.page_size)]
            if label_selector:
                query.append(("labelSelector", label_selector))
            if token:
                query.append(("continue", token))
            data = self.call("list nodes", client.call_api, "/api/v1/nodes", "GET", {}, query,
                             {"Accept": META_ACCEPT}, auth_settings=["BearerToken"],
                             response_types_map={}, _return_http_data_only=True) or {}
            yield from data.get("items") or []
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                return

    # --- Nodes: read, merge-patch, and read-modify-write on 409 -----------------------------

    def read_node(self, node: str) -> dict[str, Any]:
        """The Node object as plain JSON; NodeNotFound when there is none."""
        known, obj = self._seen(("node", node))
        if known:
            return obj
        try:
            obj = self.call(f"get node {node}", self.api.read_node, node)
            self._saw(("node", node), obj)
            return obj
        except KubeApiError as e:
            if e.status == 404:
                raise NodeNotFound(f"node {node!r} does not exist in the cluster") from e
            raise

    def patch_node(self, node: str, body: Mapping[str, Any],
                   status: bool = False) -> Optional[dict[str, Any]]:
        """Merge-patch the node (or its status); None on 409 (the caller reads again)."""
        fn = self.api.patch_node_status if status else self.api.patch_node
        try:
            result: Optional[dict[str, Any]] = self.call(
                f"patch node {node}{'/status' if status else ''}", fn, node, dict(body),
                _content_type=MERGE_PATCH)
        except BaseException as e:
            self._saw(("node", node), ...)  # whatever the server holds now, ask it next time
            if isinstance(e, KubeApiError) and e.status == 409:
                return None
            if isinstance(e, KubeApiError) and e.status == 404:
                raise NodeNotFound(f"node {node!r} does not exist in the cluster") from e
            raise
        self._saw(("node", node), result if result else ...)
        return result

    def update_node(self, node: str, change: Callable[[dict[str, Any]], Optional[dict[str, Any]]],
                    *, status: bool = False, first: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Read-modify-write with the resourceVersion as precondition, re-reading on 409.

        `change(node_obj)` returns the merge patch to send (without resourceVersion), or None when
        there is nothing to write. `first`: a copy of the node just read, used for the first round.
        """
        for _ in range(self.retry.conflict_attempts):
            obj, first = (first if first is not None else self.read_node(node)), None
            body = change(obj)
            if body is None:
                return obj
            body = dict(body)
            body["metadata"] = {**dict(body.get("metadata") or {}),
                                "resourceVersion": obj["metadata"]["resourceVersion"]}
            result = self.patch_node(node, body, status=status)
            if result is not None:
                return result
            log.info("node %s changed under us (409); reading it again", node)
        raise KubeApiError(f"node {node}: still conflicting after {self.retry.conflict_attempts} "
                           "read-modify-write rounds", 409)

    # --- ConfigMaps in the screener namespace ----------------------------------------------

    def cm_get(self, name: str) -> Optional[dict[str, Any]]:
        """The ConfigMap, or None when there is none (a consistent read)."""
        known, obj = self._seen(("configmap", name))
        if known:
            return obj
        try:
            obj = self.call(f"get configmap {self.namespace}/{name}",
                            self.api.read_namespaced_config_map, name, self.namespace)
        except KubeApiError as e:
            if e.status == 404:
                self._saw(("configmap", name), None)
                return None
            raise
        self._saw(("configmap", name), obj)
        return obj

    def cm_write(self, body: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Create (no resourceVersion) or replace (with it, as precondition) a ConfigMap.
        None when the precondition failed: 409 (changed or already exists) or 404 (deleted)."""
        name = body["metadata"]["name"]
        create = not body["metadata"].get("resourceVersion")
        self._saw(("configmap", name), ...)  # until the server answers, and whatever it answers
        try:
            if not create:
                written = self.call(f"update configmap {self.namespace}/{name}",
                                    self.api.replace_namespaced_config_map, name, self.namespace,
                                    body)
            else:
                written = self.call(f"create configmap {self.namespace}/{name}",
                                    self.api.create_namespaced_config_map, self.namespace, body)
            if written:
                self._saw(("configmap", name), written)
            return written
        except KubeApiError as e:
            if create and e.status == 404:
                # A create has one 404: its namespace is missing. Taken for a lost race, it read
                # as "budget record: still conflicting" after every retry.
                raise KubeApiError(missing_namespace(self.namespace, "the budget record and "
                                                     "the node histories"), 404) from e
            if e.status in (404, 409):
                return None
            raise

    def cm_delete(self, name: str, uid: str) -> bool:
        """Delete the ConfigMap only if it is still the object `uid` names (a precondition, so a
        slot someone else has taken since is never freed by us). False when it was not there."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        self._saw(("configmap", name), ...)
        try:
            self.call(f"delete configmap {self.namespace}/{name}",
                      self.api.delete_namespaced_config_map, name, self.namespace, body=body)
            return True
        except KubeApiError as e:
            if e.status in (404, 409):
                return False
            raise

    def cm_list(self, what: str, label_selector: str, *,
                cached: bool = False) -> Iterator[dict[str, Any]]:
        """ConfigMaps of the namespace with the label selector; `cached`: from the API server's
        cache (resourceVersion=0), for reads where a moment's staleness is harmless."""
        extra = {"resource_version": "0"} if cached else {}
        return self.pages(what, self.api.list_namespaced_config_map, self.namespace,
                          label_selector=label_selector, **extra)

    def cm_names(self, what: str, label_selector: str, *, cached: bool = False) -> list[str]:
        """Names of the ConfigMaps cm_list would give, and nothing else of them: a Table with
        no objects (includeObject=None), a fifteenth of the list's bytes for the budget's slots,
        whose managedFields alone are half of each. A server that answers with the plain list
        instead (it may: the Accept header offers it) is read the same."""
        client = self.api.api_client
        names: list[str] = []
        token: Optional[str] = None
        while True:
            query: list[tuple[str, Any]] = [("labelSelector", label_selector),
                                            ("includeObject", "None"), ("limit", self.page_size)]
            if cached:
                query.append(("resourceVersion", "0"))
            if token:
                query.append(("continue", token))
            data = self.call(what, client.call_api,
                             f"/api/v1/namespaces/{self.namespace}/configmaps", "GET", {}, query,
                             {"Accept": TABLE_ACCEPT}, auth_settings=["BearerToken"],
                             response_types_map={}, _return_http_data_only=True) or {}
            names.extend(_names(data))
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                return names


def _names(data: Mapping[str, Any]) -> list[str]:
    """Object names of a Table (the column of format "name") or of a plain list."""
    if data.get("kind") != "Table":
        return [str((i.get("metadata") or {}).get("name") or "") for i in data.get("items") or []]
    columns = [c.get("format") for c in data.get("columnDefinitions") or []]
    if "name" not in columns:
        raise KubeApiError("the Kubernetes API answered a Table without a name column", 0)
    at = columns.index("name")
    return [str(cells[at]) for r in data.get("rows") or []
            if len(cells := r.get("cells") or []) > at]


def missing_namespace(namespace: str, what: str) -> str:
    """The one line for a create refused because its namespace does not exist."""
    return (f"namespace {namespace!r} does not exist ({what} are written there): create it with "
            f"`kubectl create namespace {namespace}`, or point screener at the namespace it runs "
            "in ($POD_NAMESPACE for the store, event_namespace for Events)")


def _timed_out(e: Optional[BaseException]) -> bool:
    """Whether a failure was a timeout (the server took the connection and never answered)."""
    while e is not None:
        if isinstance(e, urllib3.exceptions.NewConnectionError):
            return False  # refused or unresolvable: fast by itself (urllib3 files it under timeouts)
        if isinstance(e, (urllib3.exceptions.TimeoutError, TimeoutError)):
            return True
        e = getattr(e, "reason", None) if isinstance(e, urllib3.exceptions.MaxRetryError) else None
    return False


def _message(e: Any) -> str:
    try:
        return str(json.loads(e.body).get("message"))
    except (TypeError, ValueError, AttributeError):
        return str(e.body)[:200] if e.body else ""
