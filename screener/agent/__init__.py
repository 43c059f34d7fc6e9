"""The node agent: the DaemonSet loop, alarm intake, screening windows, the full burn-in, the fire drill
and the daemon's metrics endpoint. It drives the pure logic through the I/O adapters."""
