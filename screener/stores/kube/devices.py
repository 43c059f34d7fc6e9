"""One GPU out of service through DRA: the node's ResourceSlices and screener's DeviceTaintRules.

Where a cluster allocates GPUs with Dynamic Resource Allocation, each node's DRA driver publishes
its devices in ResourceSlices (resource.k8s.io/v1: spec.nodeName, spec.driver, spec.pool, and
spec.devices[] with a name and attributes). A DeviceTaintRule (resource.k8s.io/v1, GA in
Kubernetes 1.37, cluster-scoped) taints the devices its selector names, as if the driver had
tainted them in the slice: with NoSchedule, no new claim that does not tolerate it is allocated
that device, while the node's other devices stay in service. This module is the API part;
screener.agent.daemon.device_taints decides when.

Finding a GPU: the node's slices of the driver, listed with the field selectors spec.nodeName and
spec.driver (the API server supports both), newest pool generation only (a consumer must ignore
slices of an older generation); the device is the one whose `uuid` attribute (the NVIDIA driver
publishes the GPU's UUID under that name, an unqualified name meaning the driver's own domain) is
the GPU's, or, on a GPU in MIG mode (whose whole device is not published), every MIG device whose
`parentUUID` is.

A rule (`rule_body`): named `screener.<pool>.<device>` (deterministic, so a replay of the same
finding finds its rule and never makes a second; a pool name is a DNS subdomain and a device name
a DNS label, which has no dot, so the name reads back unambiguously; a name past 253 characters
is `screener.<hash>.<device>`), selecting exactly (driver, pool, device), with the taint
`<taint_key>=<reason>:NoSchedule`, labelled so a node's daemon lists only its own node's rules,
annotated with the node and the GPU's UUID and serial (what a person reads, and what a passing
retest is matched by). Created once (409: the rule is read, and is ours when it selects the same
device with the same key); deleted only with its uid as precondition (so a rule someone made
again since is never removed by a stale look).

API calls (the ClusterRole in manifests/): resourceslices list; devicetaintrules create, get,
list, delete. Every call goes through the store's ApiCaller (calls.py): timeouts, retries of
transient errors, the call's deadline.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from screener.stores.kube.calls import ApiCaller, KubeApiError, TransientKubeError
from screener.stores.kube.formats import MANAGED_BY

log = logging.getLogger("screener.stores.kube")

GROUP_VERSION = "resource.k8s.io/v1"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
RULES_PATH = "/apis/resource.k8s.io/v1/devicetaintrules"
RULE_PREFIX = "screener."
NO_SCHEDULE = "NoSchedule"
# The label a node's rules carry: a hash of the node's name (a label value holds 63 characters,
# a node name up to 253). Only for listing; the admission policy binds a rule to its node by the
# selector's pool, never by this label.
LABEL_RULE_NODE = "screener.io/device-taint-node"
ANNOTATION_NODE = "screener.io/node"
ANNOTATION_GPU_UUID = "screener.io/gpu-uuid"
ANNOTATION_GPU_SERIAL = "screener.io/gpu-serial"
ANNOTATION_EVIDENCE = "screener.io/evidence"
_JSON = {"Accept": "application/json", "Content-Type": "application/json"}


@dataclass(frozen=True)
class SliceDevice:
    """One device of a ResourceSlice: where it is (driver, pool, name) and the GPU it is of."""

    driver: str
    pool: str
    name: str
    uuid: str = ""  # its `uuid` attribute (a GPU's, or a MIG device's own)
    parent_uuid: str = ""  # a MIG device's `parentUUID` (the GPU it is carved from)


def _attribute(attrs: Mapping[str, Any], name: str, driver: str) -> str:
    """A string attribute by its unqualified name or qualified with the driver's domain."""
    for key in (name, f"{driver}/{name}"):
        value = attrs.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("string"), str):
            return str(value["string"])
    return ""


def slice_devices(slices: list[dict[str, Any]], node: str, driver: str) -> list[SliceDevice]:
    """The devices of `node`'s slices of `driver`, from the newest generation of each pool."""
    mine = [s for s in slices if (s.get("spec") or {}).get("nodeName") == node
            and (s.get("spec") or {}).get("driver") == driver]
    newest: dict[str, int] = {}
    for s in mine:
        pool = (s["spec"].get("pool") or {})
        name, gen = str(pool.get("name") or ""), int(pool.get("generation") or 0)
        newest[name] = max(newest.get(name, gen), gen)
    out = []
    for s in mine:
        pool = (s["spec"].get("pool") or {})
        name = str(pool.get("name") or "")
        if not name or int(pool.get("generation") or 0) != newest[name]:
            continue
        for d in s["spec"].get("devices") or []:
            attrs = d.get("attributes") or {}
            if not isinstance(d.get("name"), str) or not isinstance(attrs, Mapping):
                continue
            out.append(SliceDevice(driver=driver, pool=name, name=d["name"],
                                   uuid=_attribute(attrs, "uuid", driver),
                                   parent_uuid=_attribute(attrs, "parentUUID", driver)))
    return out


def devices_of_gpu(devices: list[SliceDevice], gpu_uuid: str) -> list[SliceDevice]:
    """The published devices that are the GPU `gpu_uuid`: the whole GPU, else its MIG devices."""
    whole = [d for d in devices if d.uuid == gpu_uuid]
    return whole or [d for d in devices if d.parent_uuid == gpu_uuid]


def node_label(node: str) -> str:
    """The LABEL_RULE_NODE value of `node`'s rules."""
    return hashlib.sha256(node.encode()).hexdigest()[:40]


def rule_name(pool: str, device: str) -> str:
    """The rule's name (see the module docstring): screener.<pool>.<device>, or with a hash of
    the pool when that would not fit an object name."""
    name = f"{RULE_PREFIX}{pool}.{device}"
    if len(name) <= 253:
        return name
    return f"{RULE_PREFIX}{hashlib.sha256(pool.encode()).hexdigest()[:32]}.{device}"


def rule_body(node: str, device: SliceDevice, *, key: str, reason: str, gpu_uuid: str,
              gpu_serial: str = "", evidence: str = "") -> dict[str, Any]:
    """The DeviceTaintRule that takes `device` of `node` out of service (NoSchedule)."""
    annotations = {ANNOTATION_NODE: node, ANNOTATION_GPU_UUID: gpu_uuid}
    if gpu_serial:
        annotations[ANNOTATION_GPU_SERIAL] = gpu_serial
    if evidence:
        annotations[ANNOTATION_EVIDENCE] = evidence[:1024]
    return {
        "apiVersion": GROUP_VERSION, "kind": "DeviceTaintRule",
        "metadata": {"name": rule_name(device.pool, device.name),
                     "labels": {**MANAGED_BY, LABEL_RULE_NODE: node_label(node)},
                     "annotations": annotations},
        "spec": {"deviceSelector": {"driver": device.driver, "pool": device.pool,
                                    "device": device.name},
                 # A taint value is a label value: the reason's CamelCase, cut to fit.
                 "taint": {"key": key, "value": _label_value(reason), "effect": NO_SCHEDULE}},
    }


def _label_value(text: str) -> str:
    kept = "".join(c for c in text if c.isascii() and (c.isalnum() or c in "-_."))[:63]
    return kept.strip("-_.")


def is_ours(rule: Mapping[str, Any], device: SliceDevice, key: str) -> bool:
    """Whether a rule found under our name selects `device` with our taint key (a replay's)."""
    spec = rule.get("spec") or {}
    return (spec.get("deviceSelector") or {}) == {"driver": device.driver, "pool": device.pool,
                                                   "device": device.name} \
        and (spec.get("taint") or {}).get("key") == key


class KubeDeviceTaints:
    """The API part of per-GPU taints for one node's daemon (see the module docstring)."""

    def __init__(self, calls: ApiCaller, *, driver: str, taint_key: str) -> None:
        self.calls, self.driver, self.key = calls, driver, taint_key

    def body(self, node: str, device: SliceDevice, *, reason: str, gpu_uuid: str,
             gpu_serial: str = "", evidence: str = "") -> dict[str, Any]:
        """The rule for `device` of `node` with this store's taint key (rule_body)."""
        return rule_body(node, device, key=self.key, reason=reason, gpu_uuid=gpu_uuid,
                         gpu_serial=gpu_serial, evidence=evidence)

    @staticmethod
    def gpu_of(rule: Mapping[str, Any]) -> str:
        """The UUID of the GPU a rule of ours is about (its annotation)."""
        return str(((rule.get("metadata") or {}).get("annotations") or {})
                   .get(ANNOTATION_GPU_UUID) or "")

    @staticmethod
    def transient(error: BaseException) -> bool:
        """Whether a failed call is worth trying again later (the API out of reach), not a
        refusal (RBAC, admission, validation, a name taken by another rule)."""
        return isinstance(error, TransientKubeError)

    def _call(self, what: str, method: str, path: str, query: Optional[list[tuple[str, Any]]] = None,
              body: Any = None) -> Any:
        client = self.calls.api.api_client
        return self.calls.call(what, client.call_api, path, method, {}, list(query or []),
                               dict(_JSON), body=body, auth_settings=["BearerToken"],
                               response_types_map={}, _return_http_data_only=True)

    def _pages(self, what: str, path: str, query: list[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
        token: Optional[str] = None
        while True:
            q = query + [("limit", self.calls.page_size)] + ([("continue", token)] if token else [])
            data = self._call(what, "GET", path, q) or {}
            yield from data.get("items") or []
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                return

    def devices(self, node: str) -> list[SliceDevice]:
        """The node's devices of the driver (an empty list: the node publishes none: no DRA)."""
        selector = f"spec.nodeName={node},spec.driver={self.driver}"
        slices = list(self._pages(f"list resourceslices of {node}", SLICES_PATH,
                                  [("fieldSelector", selector)]))
        return slice_devices(slices, node, self.driver)

    def create(self, body: dict[str, Any], device: SliceDevice) -> bool:
        """Create the rule; True when created, False when ours was there already (a replay).
        A rule under our name that selects something else is an error (KubeApiError 409)."""
        name = body["metadata"]["name"]
        try:
            self._call(f"create devicetaintrule {name}", "POST", RULES_PATH, body=body)
            return True
        except KubeApiError as e:
            if e.status != 409:
                raise
        there = self._call(f"get devicetaintrule {name}", "GET", f"{RULES_PATH}/{name}") or {}
        if is_ours(there, device, self.key):
            return False
        raise KubeApiError(f"devicetaintrule {name} exists and selects "
                           f"{(there.get('spec') or {}).get('deviceSelector')}, not "
                           f"{device.driver}/{device.pool}/{device.name}: left alone", 409)

    def rules(self, node: str) -> list[dict[str, Any]]:
        """The rules this node's daemon made (by label, then by pool: a label is not proof)."""
        out = []
        for rule in self._pages(f"list devicetaintrules of {node}", RULES_PATH,
                                [("labelSelector", f"{LABEL_RULE_NODE}={node_label(node)}")]):
            meta = rule.get("metadata") or {}
            if str(meta.get("name") or "").startswith(RULE_PREFIX) and \
                    (meta.get("annotations") or {}).get(ANNOTATION_NODE) == node and \
                    ((rule.get("spec") or {}).get("taint") or {}).get("key") == self.key:
                out.append(rule)
        return out

    def delete(self, rule: Mapping[str, Any]) -> bool:
        """Delete the rule if it is still the object read (its uid as precondition); False when
        it was gone or had been made again since."""
        name, uid = rule["metadata"]["name"], rule["metadata"]["uid"]
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            self._call(f"delete devicetaintrule {name}", "DELETE", f"{RULES_PATH}/{name}",
                       body=body)
            return True
        except KubeApiError as e:
            if e.status in (404, 409):
                return False
            raise
