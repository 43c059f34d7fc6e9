# The screener image: the DaemonSet, the burn-in Job and the peer burn-in Job all run it.
#
#   docker build -t REGISTRY/screener:0.1.0 .      (docs/deploy.md: "Build and deploy")
#
# torch from PyPI (the default Linux wheel) carries its own CUDA runtime, cuBLAS, cuDNN and NCCL;
# the NVIDIA driver and libnvidia-ml (NVML) come from the node through the NVIDIA container runtime
# (RuntimeClass `nvidia`). Every Python dependency is pinned in requirements-image.txt. The job
# specs and committed goldens are package data inside the installed wheel; a site's goldens come
# from the screener-golden ConfigMap (SCREENER_GOLDEN_DIR / golden_dir in daemon.toml).

# --- build: a virtual environment with the pinned dependencies and the screener wheel ------------
FROM python:3.11.7-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# A C compiler for the optional compiled fingerprint kernel (screener.kernels); only in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Dependencies first, so a code change does not reinstall torch.
COPY requirements-image.txt ./
RUN python -m venv /opt/screener \
    && /opt/screener/bin/pip install -r requirements-image.txt

COPY pyproject.toml README.md ./
COPY screener ./screener
COPY jobs ./jobs
COPY golden ./golden
# Build the wheel (data included) and install it without touching the pinned dependencies.
RUN /opt/screener/bin/pip wheel --no-deps -w /tmp/wheels . \
    && /opt/screener/bin/pip install --no-deps /tmp/wheels/screener-*.whl \
    && /opt/screener/bin/pip check

# --- runtime ---------------------------------------------------------------------------------------
FROM python:3.11.7-slim-bookworm

ENV PATH=/opt/screener/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

COPY --from=build /opt/screener /opt/screener

# Non-root by default (uid/gid 65532, the peer burn-in Job's user). The DaemonSet and the burn-in
# Job set runAsUser: 0 themselves, for the reasons in docs/deploy.md ("What the pods run as, and
# why"): reading /dev/kmsg needs CAP_SYSLOG, which a non-root container cannot use, and they share
# root-owned hostPath state with each other.
RUN groupadd --system --gid 65532 screener \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin screener \
    && screener --version \
    && python -c "import screener.agent.daemon.loop, screener.stores.kube.store, screener.remediation.hyperpod, screener.audit"
USER 65532:65532
WORKDIR /tmp

ENTRYPOINT ["screener"]
CMD ["daemon"]
