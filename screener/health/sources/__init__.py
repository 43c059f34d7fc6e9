"""The adapters that read the node's health: NVML, the kernel log, the host (psutil) and the HBM
pattern test. Each vendor library is imported here and nowhere else."""
