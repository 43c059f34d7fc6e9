"""The node agent: the DaemonSet loop and its parts (daemon/), the screening window and its worker
(screening/), the full burn-in (burnin/), the preflight, the fire drill, the daemon's metrics
endpoint and the node-local health answer. It drives the pure logic through the I/O adapters."""
