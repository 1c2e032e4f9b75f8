# syntax=docker/dockerfile:1
# The replica image: the engine with CUDA torch on the CUDA runtime image (default), or CPU torch on
# slim Python (VARIANT=cpu). Build from the repository root (the context; see .dockerignore):
#   docker build -f deploy/docker/replica.Dockerfile -t kvroute-replica .
#   docker build -f deploy/docker/replica.Dockerfile --build-arg FLASH_ATTN=1 -t kvroute-replica:fa .
#   docker build -f deploy/docker/replica.Dockerfile --build-arg VARIANT=cpu -t kvroute-replica:cpu .
# Run: docker run --gpus all -p 50051:50051 kvroute-replica --redis-url redis://HOST:6379/0
# (every flag is also a KVROUTE_* variable: python -m replica --help).
ARG VARIANT=cuda
ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# -- the two bases of each variant: build (compilers) and run -----------------------------------------
# CUDA: build on the devel image (nvcc, for a flash-attn source build), run on the runtime image;
# Ubuntu's python3 in both, so the virtualenv's interpreter path is the same.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ git \
    && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS run-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

FROM python:${PYTHON_VERSION}-slim AS build-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM python:${PYTHON_VERSION}-slim AS run-cpu

# -- build: torch first (the variant's wheel), then the package, then flash-attn if asked ------------
FROM build-${VARIANT} AS build
ARG VARIANT
# The CPU variant takes torch from PyTorch's CPU wheel index (PyPI's Linux wheel is the CUDA build).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    elif [ "$VARIANT" = cpu ]; then pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; \
    else pip install "torch==${TORCH_VERSION}"; fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvroute/ kvroute/
COPY replica/ replica/
COPY kvroute_tools/ kvroute_tools/
# torch is already there: '.[replica]' keeps it (torch>=2.4) instead of fetching another build
RUN pip install ".[replica]"
RUN if [ "$FLASH_ATTN" = 1 ]; then \
      [ "$VARIANT" = cuda ] || { echo "FLASH_ATTN=1 needs VARIANT=cuda" >&2; exit 1; }; \
      pip install packaging ninja && pip install "flash-attn==${FLASH_ATTN_VERSION}" --no-build-isolation; \
    fi

# -- runtime: the virtualenv alone, as a non-root user -------------------------------------------------
FROM run-${VARIANT}
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/venv /opt/venv
# The generated default model goes to ~/.cache/kvroute/models unless --model / KVROUTE_MODEL is set.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    KVROUTE_HOST=0.0.0.0
USER 10001
WORKDIR /home/kvroute
# gRPC (GenerationService, ReplicaService, grpc.health.v1); HTTP API and metrics ports are off
# unless KVROUTE_HTTP_PORT / KVROUTE_METRICS_PORT are set.
EXPOSE 50051
ENTRYPOINT ["python", "-m", "replica"]
