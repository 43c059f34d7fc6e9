"""Idle detection: is anyone else using this node's GPUs, and for how long has nobody been?

A node is idle when, for the whole idle window T:
  * no compute process runs on any GPU except the screener's own (NVML's process list),
  * no pod on the node requests nvidia.com/gpu except the screener's own (the Kubernetes pod list;
    outside a cluster there is none to ask),
  * every GPU's utilisation is under the threshold.

During a screen our own known-answer processes use the GPUs, so there `job_landed` looks only at
foreign processes and foreign GPU pods, never at utilisation.

The PIDs NVML reports are those of the host's PID namespace, which is why the DaemonSet runs with
hostPID (see manifests/daemonset.yaml): only then can our own PIDs be told from a job's.

Pure functions over plain snapshots; the clock is passed in, and our own PIDs too (the host
adapter, screener.health.sources.host.own_pids, reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from screener.health.verdict.snapshot import GpuSnapshot


@dataclass(frozen=True)
class Activity:
    """What was running on the node's GPUs at one moment (by someone other than us)."""

    foreign_processes: tuple[tuple[str, int], ...] = ()  # (GPU label, PID)
    gpu_pods: tuple[str, ...] = ()  # "namespace/name" of pods requesting GPUs
    busy_gpus: tuple[tuple[str, int], ...] = ()  # (GPU label, utilisation %) at/over the threshold
    unknown: tuple[str, ...] = ()  # what could not be checked (e.g. the pod list failed)

    @property
    def job_present(self) -> bool:
        """A job is on the node: a foreign compute process or a foreign GPU pod."""
        return bool(self.foreign_processes or self.gpu_pods)

    @property
    def busy(self) -> bool:
        """Not idle right now (a job, high utilisation, or something we could not check)."""
        return bool(self.job_present or self.busy_gpus or self.unknown)

    @property
    def reason(self) -> str:
        parts = []
        if self.gpu_pods:
            parts.append("GPU pod(s) " + ", ".join(self.gpu_pods))
        if self.foreign_processes:
            parts.append("compute process(es) " + ", ".join(f"{pid} on GPU {g}"
                                                            for g, pid in self.foreign_processes))
        if self.busy_gpus:
            parts.append("utilisation " + ", ".join(f"{u}% on GPU {g}" for g, u in self.busy_gpus))
        if self.unknown:
            parts.append("cannot tell: " + "; ".join(self.unknown))
        return "; ".join(parts) or "idle"

    def to_dict(self) -> dict[str, Any]:
        return {"job_present": self.job_present, "busy": self.busy, "reason": self.reason,
                "foreign_processes": [list(x) for x in self.foreign_processes],
                "gpu_pods": list(self.gpu_pods), "busy_gpus": [list(x) for x in self.busy_gpus],
                "unknown": list(self.unknown)}


def observe(gpus: Sequence[GpuSnapshot], pods: Optional[Iterable[Mapping[str, Any]]], *,
            own: Iterable[int] = (), own_pod: str = "", utilization_pct: int = 5,
            pods_error: str = "") -> Activity:
    """Activity from one probe's GPU snapshots and the node's GPU pod list.

    pods: the kube store's gpu_pods(node) (dicts with name and namespace), or None outside a
        cluster. own: our own PIDs. own_pod: our pod's name (never counted). pods_error: why the
        pod list could not be read, if it could not.
    """
    mine = set(own)
    foreign = []
    busy = []
    unknown = []
    for g in gpus:
        if g.processes is None and ("processes" in g.errors or "handle" in g.errors):
            # NVML failed to list them: a job may be running there, so not idle.
            unknown.append(f"compute processes on GPU {g.label}: "
                           f"{g.errors.get('processes') or g.errors.get('handle')}")
        for p in g.processes or ():
            if p.pid not in mine:
                foreign.append((g.label, int(p.pid)))
        if g.utilization_gpu is not None and g.utilization_gpu >= utilization_pct:
            busy.append((g.label, int(g.utilization_gpu)))
    names = []
    for pod in pods or ():
        if own_pod and pod.get("name") == own_pod:
            continue
        names.append(f"{pod.get('namespace', '')}/{pod.get('name', '')}")
    if pods_error:
        unknown.append(f"pod list: {pods_error}")
    return Activity(foreign_processes=tuple(sorted(foreign)), gpu_pods=tuple(sorted(names)),
                    busy_gpus=tuple(sorted(busy)), unknown=tuple(unknown))


class IdleTracker:
    """Remembers since when the node has been quiet; idle once quiet for `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        self.quiet_since: Optional[float] = None
        self.last: Optional[Activity] = None

    def update(self, activity: Activity, now: float) -> bool:
        """Feed one observation; returns whether the node is idle now."""
        self.last = activity
        if activity.busy:
            self.quiet_since = None
            return False
        if self.quiet_since is None:
            self.quiet_since = now
        return self.idle(now)

    def idle(self, now: float) -> bool:
        return self.quiet_since is not None and now - self.quiet_since >= self.window_s

    def reset(self) -> None:
        """Forget the quiet period (after our own screen, which used the GPUs itself)."""
        self.quiet_since = None
