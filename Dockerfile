# toolpool serve in a container: docker build -t toolpool . (see docs/service.md)
#
# The image runs as root: the `untrusted` profile changes each worker to a uid of its own,
# which needs root (with the capabilities deploy/kubernetes/deployment.yaml grants). The
# service itself drops nothing it needs; its tools run as those other uids.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# Your tools: install them here too (a wheel, or COPY your package and pip install it).
RUN pip install ".[serve]" && rm -rf /src
WORKDIR /

EXPOSE 8080
# The service drains on SIGTERM; it is PID 1 here and runs its own small init (signals
# forwarded, orphans reaped: docs/service.md, "PID 1").
STOPSIGNAL SIGTERM
ENTRYPOINT ["toolpool", "serve"]
CMD ["--config=/etc/toolpool/service.toml", "--http=0.0.0.0:8080", \
     "--token-file=/var/run/secrets/toolpool/token", "--log-format=json"]
