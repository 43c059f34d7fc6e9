"""GPU and host health probes: what the hardware itself reports, turned into Findings.

Two folders, one per layer, and the probe run that joins them:

- ``verdict/`` (pure logic): ``snapshot``, plain dataclasses of what was observed (GPUs, Xid
  events, host); ``xid``, NVIDIA's Xid catalog with our classification (hardware / software /
  informational); ``rules``, snapshots (previous and current) -> Findings; ``idle``, idle
  detection over probe snapshots and the GPU pod list;
- ``sources/`` (the adapters that read the node): ``nvml``, the only importer of pynvml
  (imported lazily); ``kmsg``, the kernel-log Xid parser and reader that keeps its position;
  ``host``, the only importer of psutil (mounts, memory, disk, boot time, our own PIDs, the
  screen workers' processes named by PID and start time); ``hbm``, the HBM pattern test (torch;
  run by the burn-in's worker, never by the daemon);
- ``probes``: ``run_probes``, which reads the sources once, applies the rules and returns a
  ``ProbeReport``.

The probe configuration, ``ProbeConfig``, lives in ``screener.settings.health``.

Importing this package loads none of the vendor libraries.
"""
