"""What the daemon touches outside itself, as one value: `DaemonPorts`.

The daemon (screener.agent.daemon.loop) reads, writes and runs nothing directly: every store, probe,
runner, clock and callback it uses is a field here. `screener.commands.daemon` wires the real ones
(the kube or local store, NVML, the screen worker, the SageMaker deep check), the fire drill wires
simulated ones, and tests pass fakes at the same boundary. A field left None is a capability this
node does not have (outside a cluster: no node object, so no GPU pods, no annotations, no spool).

The outside world comes at its own grain where it is one thing: the node's object in the cluster
is one port (`NodeObject`: its GPU pods, its annotations, when it was created, and the two
catch-ups of every pass), not five callables unbundled from one store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

from screener.agent.daemon.clock import ClockLike
from screener.agent.daemon.device_taints import DeviceTaintApi
from screener.agent.health_answer import AnswerBoard
from screener.agent.metrics import DaemonMetrics
from screener.agent.screening.window import ScreenRunner, TaintControl
from screener.health.sources import host
from screener.health.probes import ProbeReport
from screener.lifecycle.ports import Store
from screener.remediation.ladder import Repairs, Slots

ProbeFn = Callable[[Optional[ProbeReport]], ProbeReport]


class NodeObject(Protocol):
    """This node's object in the cluster (screener.stores.kube.bound.KubeNodeObject: the kube
    store bound to the node)."""

    def gpu_pods(self) -> list[Any]:
        """The pods on the node that hold GPUs (dicts with name and namespace)."""

    def publish(self, annotations: Mapping[str, Optional[str]]) -> None:
        """Set (a None value: remove) annotations on the Node."""

    def created(self) -> Optional[float]:
        """When the Node object was created (unix seconds; None when unknown)."""

    def replay(self) -> int:
        """Write the transitions the API did not take (the spool); how many were written."""

    def finish(self) -> int:
        """Finish the transitions a killed predecessor left half-written (the intents); how
        many."""


class Host(Protocol):
    """The machine the daemon runs on (ThisHost: the real one, as health.host reads it)."""

    def own_pids(self) -> set[int]:
        """This daemon's processes and their children (its screens): not a job's."""

    def boot_time(self) -> float:
        """When the host booted (unix seconds): an Xid from before it was recovered by the
        reboot, and a reboot the ladder asked for shows as a later boot."""

    def boot_id(self) -> Optional[str]:
        """The kernel's id of this boot (a new one at every boot, whatever the wall clock
        does), or None where it is not read: it proves a reboot where it can be."""


@dataclass(frozen=True)
class ThisHost:
    """The real host. boot_id_path: where the kernel's boot id is read ([probes] boot_id_path);
    None: not read."""

    boot_id_path: Optional[str] = None

    def own_pids(self) -> set[int]:
        return host.own_pids()

    def boot_time(self) -> float:
        return host.boot_time()

    def boot_id(self) -> Optional[str]:
        return host.boot_id(self.boot_id_path) if self.boot_id_path else None


@dataclass
class DaemonPorts:
    """Everything a Daemon uses outside itself (see the module docstring).

    store: where states live (LocalStore or KubeStore). probe(previous) -> ProbeReport. runner:
        the screen runner (screening.KatProcessRunner, or a test's function). taint: adds and
        removes the screening taint (KubeStore, or screening.LocalTaint).
    node_object: the node's object in the cluster (NodeObject; KubeNodeObject on the kube
        store), or None outside a cluster: then no GPU pods are listed, nothing is published,
        nothing spooled is replayed and no intent finished. host: the machine (Host: our
        PIDs, its boot time and boot id; default ThisHost()). on_quarantine(node): the optional
        deep health check. reap(): ends screen workers a killed predecessor left
        (screening.reap_stale_screens bound to the runner's work_dir) or None. commit_kmsg():
        saves the kernel-log position (DeferredKernelLogReader.commit) once what it read is
        durable, or None.
    metrics: the daemon's metrics (default: fresh ones for the node). clock: a clock.Clock (wall
        and monotonic) or one callable standing for both (a test clock that never steps); default
        the system's. stop: set to end the loop (SIGTERM); default a fresh event.
    untaint_delay_s: the screening window's wait before it retries removing the taint. uid: the
        uid that must own the alarm folder (default: the daemon's own). tool_env: the environment
        (PATH) the repair ladder runs nvidia-smi and dcgmi in (default: the daemon's own).
    repair_slots: the fleet-wide reboot slots (screener.stores.slots) and repairs: the reboot and
        replace calls (screener.remediation.repairs), for a ladder that reboots or replaces.
    answer: the node-local health answer the daemon publishes into (health_answer.AnswerBoard;
        default: a fresh one), which the command serves on the socket and the HTTP port.
    device_taints: the node's ResourceSlices and DeviceTaintRules (screener.stores.kube.devices.
        KubeDeviceTaints, with the kube store and [dra] enabled), or None: no per-GPU taints.
    """

    store: Store
    probe: ProbeFn
    runner: ScreenRunner
    taint: TaintControl
    node_object: Optional[NodeObject] = None
    host: Host = field(default_factory=ThisHost)
    on_quarantine: Optional[Callable[[str], Any]] = None
    reap: Optional[Callable[[], Any]] = None
    commit_kmsg: Optional[Callable[[], None]] = None
    metrics: Optional[DaemonMetrics] = None
    clock: Optional[ClockLike] = None
    stop: Optional[threading.Event] = None
    untaint_delay_s: float = 1.0
    uid: Optional[int] = None
    tool_env: Optional[Mapping[str, str]] = None
    repair_slots: Optional[Slots] = None
    repairs: Optional[Repairs] = None
    answer: Optional[AnswerBoard] = None
    device_taints: Optional[DeviceTaintApi] = None
