"""GPU and host health probes: what the hardware itself reports, turned into Findings.

Modules, lowest first:

- ``snapshot``: plain dataclasses of what was observed (GPUs, Xid events, host);
- ``xid``: NVIDIA's Xid catalog with our classification (hardware / software / informational);
- ``nvml``: the NVML adapter, the only importer of pynvml (imported lazily);
- ``kmsg``: the kernel-log Xid parser and reader that keeps its position;
- ``host``: the only importer of psutil: host checks (mounts, memory, disk), boot time, our own
  PIDs, and the screen workers' processes named by PID and start time;
- ``rules``: pure rules, snapshots (previous and current) -> Findings;
- ``idle``: pure idle detection over probe snapshots and the GPU pod list;
- ``hbm``: the HBM pattern test (torch; run by the burn-in's worker, never by the daemon);
- ``probes``: ``run_probes``, which runs everything once and returns a ``ProbeReport``.

The probe configuration, ``ProbeConfig``, lives in ``screener.settings.health``.

Importing this package loads none of the vendor libraries.
"""
