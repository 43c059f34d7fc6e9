"""Remediation and planning: SageMaker HyperPod (deep health check, reboot, replace), DCGM correlation
from Prometheus, and checkpoint-interval planning."""
