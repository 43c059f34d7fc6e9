"""What the daemon touches outside itself, as one value: `DaemonPorts`.

The daemon (screener.agent.daemon.loop) reads, writes and runs nothing directly: every store, probe,
runner, clock and callback it uses is a field here. `screener.commands.daemon` wires the real ones
(the kube or local store, NVML, the screen worker, the SageMaker deep check), the fire drill wires
simulated ones, and tests pass fakes at the same boundary. A field left None is a capability this
node does not have (outside a cluster: no node object, so no GPU pods, no annotations, no spool).

The outside world comes at its own grain where it is one thing: the node's object in the cluster
is one port (`NodeObject`: its GPU pods, its annotations, when it was created, and the two
catch-ups of every pass), not five callables unbundled from one store; the machine and the
daemon's process on it are one (`Host`: PIDs, boot, uid, the tools' environment); the health
probes are one (`Probes`: a run, and the kernel-log position saved once what it read is
durable); the repair ladder's reach is one (`RepairPorts`: the fleet's reboot slots and the
reboot and replace calls). The node's states, history and the quarantine budget are the store
(`screener.lifecycle.ports.Store`, the lifecycle's own port). What the daemon decides by is its
config (`DaemonConfig`), never a port.
"""

from __future__ import annotations

import os
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

class Probes(Protocol):
    """The node's health probes (screener.health.probes.NodeProbes: NVML, the kernel log, the
    host)."""

    def run(self, previous: Optional[ProbeReport]) -> ProbeReport:
        """Probe once; previous: the last report, which the rules compare with."""

    def commit(self) -> None:
        """Save the kernel-log position up to what the last run read: called once what that
        run found is durable (recorded or spooled), so a crash before rereads it."""


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

    def uid(self) -> int:
        """The uid the daemon runs as: the alarm folder must be its own."""

    def tool_env(self) -> Optional[Mapping[str, str]]:
        """The environment (PATH) the repair ladder runs nvidia-smi and dcgmi in; None: the
        daemon's own."""


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

    def uid(self) -> int:
        return os.geteuid()

    def tool_env(self) -> Optional[Mapping[str, str]]:
        return None


@dataclass(frozen=True)
class RepairPorts:
    """What the repair ladder's rungs 2 and 3 reach: the fleet-wide reboot slots (the store's
    pool, store.slots) and the reboot and replace calls (screener.remediation.repairs)."""

    slots: Slots
    calls: Repairs


@dataclass
class DaemonPorts:
    """Everything a Daemon uses outside itself (see the module docstring).

    store: where states, histories and the quarantine budget live (LocalStore or KubeStore).
        probes: the health probes (Probes). runner: the screen runner
        (screening.ScreenProcessRunner, or a test's function). taint: adds and removes the
        screening taint (KubeStore, or screening.LocalTaint).
    node_object: the node's object in the cluster (NodeObject; KubeNodeObject on the kube
        store), or None outside a cluster: then no GPU pods are listed, nothing is published,
        nothing spooled is replayed and no intent finished. host: the machine (Host: our
        PIDs, its boot time and boot id, its uid, the tools' environment; default ThisHost()).
        on_quarantine(node): the optional deep health check. reap(): ends screen workers a
        killed predecessor left (screening.reap_stale_screens bound to the runner's work_dir)
        or None.
    metrics: the daemon's metrics (default: fresh ones for the node). clock: a clock.Clock (wall
        and monotonic) or one callable standing for both (a test clock that never steps); default
        the system's. stop: set to end the loop (SIGTERM); default a fresh event.
    repair: the reboot slots and the reboot and replace calls (RepairPorts), for a ladder that
        reboots or replaces; None: it does neither.
    answer: the node-local health answer the daemon publishes into (health_answer.AnswerBoard;
        default: a fresh one), which the command serves on the socket and the HTTP port.
    device_taints: the node's ResourceSlices and DeviceTaintRules (screener.stores.kube.devices.
        KubeDeviceTaints, with the kube store and [dra] enabled), or None: no per-GPU taints.
    """

    store: Store
    probes: Probes
    runner: ScreenRunner
    taint: TaintControl
    node_object: Optional[NodeObject] = None
    host: Host = field(default_factory=ThisHost)
    on_quarantine: Optional[Callable[[str], Any]] = None
    reap: Optional[Callable[[], Any]] = None
    metrics: Optional[DaemonMetrics] = None
    clock: Optional[ClockLike] = None
    stop: Optional[threading.Event] = None
    repair: Optional[RepairPorts] = None
    answer: Optional[AnswerBoard] = None
    device_taints: Optional[DeviceTaintApi] = None
