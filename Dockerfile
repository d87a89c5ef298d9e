FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FENCEGATE_HOST=0.0.0.0 \
    FENCEGATE_PORT=8080 \
    FENCEGATE_CONSOLE_HOST=0.0.0.0 \
    FENCEGATE_CONSOLE_PORT=8090

WORKDIR /src
COPY pyproject.toml README.md ./
COPY fencegate ./fencegate
COPY sql ./sql
RUN pip install . && rm -rf /src

RUN useradd --system --create-home --home-dir /var/lib/fencegate fencegate
USER fencegate
# The embedded SQLite store (./fencegate.db) lives here unless FENCEGATE_DATABASE_URL is set.
WORKDIR /var/lib/fencegate
VOLUME ["/var/lib/fencegate"]

# 8080: the gateway; 8090: the operator's console, when the container runs it instead:
#   docker run -p 8090:8090 -e FENCEGATE_CONSOLE_TOKENS_FILE=/run/secrets/tokens.toml \
#       -e FENCEGATE_DATABASE_URL=postgresql://… --entrypoint fencegate IMAGE console
# Inside a container it listens on every interface (the published port is the boundary).
EXPOSE 8080 8090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('FENCEGATE_PORT', '8080'), timeout=2)"]

# The gateway refuses to start on a database without the schema it needs. On PostgreSQL,
# migrate once per release, before the new gateways start:
#   docker run --rm --entrypoint fencegate IMAGE migrate --database-url postgresql://app@db/app
# or let each gateway migrate on start (concurrent runs are serialised by an advisory lock):
#   docker run -e FENCEGATE_MIGRATE=true -e FENCEGATE_DATABASE_URL=postgresql://… IMAGE --upstream …
# The embedded SQLite store is migrated on start by default.
ENTRYPOINT ["fencegate", "serve"]
