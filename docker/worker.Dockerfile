# syntax=docker/dockerfile:1
# The sigprop validation worker (`sigprop worker`: RQ jobs on the Redis at SIGPROP_REDIS_URL).
# Build from the repository root. GPU (default; CUDA build of PyTorch from the base image):
#   docker build -f docker/worker.Dockerfile -t sigprop-worker .
# CPU only (a slim Python base plus PyTorch's CPU wheel, ~200 MB instead of several GB):
#   docker build -f docker/worker.Dockerfile -t sigprop-worker:cpu \
#     --build-arg BASE_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7 --build-arg TORCH_CPU=1 .
# The build needs the network (pip, and download.pytorch.org for the CPU wheel); the running
# image needs none: the `digits` data set ships inside scikit-learn.
# pinned by digest (pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime)
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime@sha256:c8268a92a69bd500f8be0e665b2630ee006dadaf7bfbc24249141b15ff622755
FROM ${BASE_IMAGE}

# 1: install the CPU-only torch wheel before sigprop, so `.[worker]` finds torch satisfied and
# does not pull the default (CUDA) wheel from PyPI. Leave at 0 on the pytorch/pytorch base,
# whose torch already satisfies torch>=2.2.
ARG TORCH_CPU=0
# The CPU wheel's version (the GPU base image above ships torch 2.5.1 too).
ARG TORCH_VERSION=2.5.1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --user-group sigprop

WORKDIR /src
COPY . /src
RUN if [ "$TORCH_CPU" = "1" ]; then \
        pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"; \
    fi \
    && pip install --no-cache-dir "./[worker]"

# Numeric uid:gid (the sigprop user above), so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/sigprop

# Healthy while Redis answers (with the configured password/TLS) and this container's worker is
# registered with RQ; a worker's registration expires when it dies or hangs.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["sigprop", "worker", "--check"]

# The worker uses CUDA when torch.cuda.is_available() (compose reserves the GPUs), else the CPU.
CMD ["sigprop", "worker"]
