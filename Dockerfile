# metanode in a container: `docker build -t metanode .` then see README ("Container").
FROM python:3.11-slim

# MALLOC_ARENA_MAX: glibc's malloc gives each thread that allocates an arena of its own, and
# the pages freed in them stay resident: 233 MiB after a churn soak, 137 MiB with two
# (docs/operations.md, "Running for months")
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    METANODE_DATA_DIR=/data \
    METANODE_WATCH_ROOTS=/files/watch

# ffprobe gives the mediainfo plugin its stream facts (without it the plugin records a skip)
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY metanode ./metanode
COPY plugins ./plugins
RUN pip install --no-cache-dir . ./plugins/fullhash ./plugins/fileinfo ./plugins/filename \
    ./plugins/mediainfo ./plugins/nfo

RUN useradd --system --uid 1000 --user-group --home-dir /data metanode \
    && mkdir -p /data /files/watch \
    && chown metanode:metanode /data /files/watch
USER metanode

VOLUME ["/data"]
EXPOSE 9000
# `metanode health` finds the node as any client does: where the node serving /data says it
# listens (its `serving` file), whatever port it was given, else METANODE_CONFIG, METANODE_PORT…;
# its exit 2 (no answer) is one Docker reserves, so every failure is told as 1
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["sh", "-c", "metanode health > /dev/null || exit 1"]
CMD ["metanode", "serve", "--host", "0.0.0.0"]
