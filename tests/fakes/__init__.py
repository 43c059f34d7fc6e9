"""Test doubles shared by several test files (imported as `fakes.<module>`; tests/ is on the path):

- fake_nvml: a scripted stand-in for the pynvml module;
- nvidia_tools: stand-ins for nvidia-smi, dcgmi and reboot, with the real tools' output;
- clock: the one FakeClock (wall, monotonic, a wall-clock step);
- daemon: the daemon rig on a FakeClock, the scripted screen runner, outcome and alarm builders;
- fleet: a reported fleet (a burn-in report and a LocalStore of five nodes' history).

Helpers that are not doubles (the rendered manifests, the PrometheusRule, a DDP process group,
the CLI) are in tests/*_util.py. No test module imports another.
"""
