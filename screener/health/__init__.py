"""GPU and host health probes: what the hardware itself reports, turned into Findings.

Modules, lowest first:

- ``snapshot``: plain dataclasses of what was observed (GPUs, Xid events, host);
- ``xid``: NVIDIA's Xid catalog with our classification (hardware / software / informational);
- ``nvml``: the NVML adapter, the only importer of pynvml (imported lazily);
- ``kmsg``: the kernel-log Xid parser and reader that keeps its position;
- ``host``: host checks through psutil;
- ``config``: ``ProbeConfig``, the frozen configuration;
- ``rules``: pure rules, snapshots (previous and current) -> Findings;
- ``probes``: ``run_probes``, which runs everything once and returns a ``ProbeReport``.

Importing this package loads none of the vendor libraries.
"""
