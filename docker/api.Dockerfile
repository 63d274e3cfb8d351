# syntax=docker/dockerfile:1
# The sigprop HTTP API. Build from the repository root:
#   docker build -f docker/api.Dockerfile -t sigprop-api .
# The build needs the network (pip fetches the dependencies); the running image needs none.
# python:3.11-slim, pinned by digest (a rebuild of the tag cannot change what is built)
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SIGPROP_DATA_DIR=/data

# A fixed non-root user; /data holds the embedded SQLite cache when SIGPROP_REDIS_URL is unset.
RUN useradd --create-home --uid 10001 --user-group sigprop \
    && mkdir -p /data \
    && chown sigprop:sigprop /data

WORKDIR /src
COPY . /src
RUN pip install --no-cache-dir "./[server]"

# Numeric uid:gid (the sigprop user above), so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/sigprop
VOLUME ["/data"]
EXPOSE 8000

# /readyz answers 200 once the cache is reachable and the engine is warm, 503 otherwise
# (urlopen raises on 503, so the exit status is non-zero). slim images have no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]

CMD ["sigprop", "serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
