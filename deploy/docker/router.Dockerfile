# syntax=docker/dockerfile:1
# The router image: slim Python and the router's install set ('.[router]': no torch, no
# matplotlib, no transformers), plus `kvroute bridge` ('.[bridge]', the chart's sidecar beside a
# vLLM server: replica/bridge and the Redis publisher it shares, no engine). Build from the repository root (the context; see .dockerignore):
#   docker build -f deploy/docker/router.Dockerfile -t kvroute-router .
# Run: docker run -p 50050:50050 kvroute-router --redis-url redis://HOST:6379/0 --model /models/NAME
# (every flag is also a KVROUTE_* variable: python -m router --help).
ARG PYTHON_VERSION=3.11

# -- build: compile the optional C extensions into a virtualenv --------------------------------------
FROM python:${PYTHON_VERSION}-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvroute/ kvroute/
COPY router/ router/
COPY kvroute_tools/ kvroute_tools/
# The rest of replica/ stays out: the router never imports it (its optional C extension is skipped)
COPY replica/__init__.py replica/__init__.py
COPY replica/bridge/ replica/bridge/
COPY replica/publisher/ replica/publisher/
# The default model's generator, for the chart's init container (`resolve_model --tokenizer-only`:
# the tokenizer and config without weights; torch is not installed here and not imported).
COPY replica/model/ replica/model/
RUN pip install ".[router,bridge]"

# -- runtime: the virtualenv alone, as a non-root user -------------------------------------------------
FROM python:${PYTHON_VERSION}-slim
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    KVROUTE_HOST=0.0.0.0
USER 10001
WORKDIR /home/kvroute
# gRPC (GenerationService, RouterService, grpc.health.v1); HTTP API and metrics ports are off
# unless KVROUTE_HTTP_PORT / KVROUTE_METRICS_PORT are set.
EXPOSE 50050
ENTRYPOINT ["python", "-m", "router"]
