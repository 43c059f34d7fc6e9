"""The DaemonSet loop (loop) and its parts, one module each: alarm intake (intake), the
findings bookkeeping (findings), the lifecycle feed (feed), the screening step
(screens), adoption (adoption), the fleet quorum's half (fleet), per-GPU taints
(device_taints), what it touches outside itself (ports), what one pass did
(passreport), its clocks (clock) and log format (jsonlog)."""
