"""Remediation: SageMaker HyperPod (deep health check, reboot, replace), the repair ladder and the
NVIDIA tools it drives, the ladder's reboot and replace calls (repairs), and DCGM correlation from
Prometheus. One layer (adapters); the checkpoint-interval planning is pure and lives in
screener.lifecycle.recovery."""
