# The screener image: the DaemonSet, burn-in and peer burn-in all run it.
#
#   docker build -t ghcr.io/screener/screener:0.1.0 .
#
# torch from PyPI carries its own CUDA runtime, cuBLAS, cuDNN and NCCL; the NVIDIA driver (and
# libnvidia-ml for NVML) comes from the node through the NVIDIA container runtime. jobs/ and golden/
# are installed next to the package (the package finds them there); site goldens come from the
# screener-golden ConfigMap (SCREENER_GOLDEN_DIR / golden_dir in daemon.toml).
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/screener
# Dependencies first, so a code change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p screener && echo '__version__ = "0.0.0"' > screener/__init__.py \
    && pip install torch==2.13.0 \
    && pip install . \
    && pip uninstall -y screener \
    && rm -rf screener build
COPY screener ./screener
COPY jobs ./jobs
COPY golden ./golden
# Editable-style install keeps jobs/ and golden/ next to the package, where defaults look.
RUN pip install --no-deps -e . && python -c "import screener.cli, screener.daemon"

# The DaemonSet runs as root with every capability dropped but SYSLOG (see manifests/daemonset.yaml);
# the Jobs may run as any user.
ENTRYPOINT ["screener"]
CMD ["daemon"]
