FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml Makefile README.md ./
COPY specstream specstream
COPY gateway gateway
COPY clients clients
# CPU torch by default; build with --build-arg TORCH_SPEC=torch for another build.
ARG TORCH_SPEC="torch==2.13.0"
RUN make setup TORCH_SPEC="$TORCH_SPEC" SETUP_NGINX=0
ENV SPECSTREAM_CACHE_DIR=/cache SPECSTREAM_HOST=0.0.0.0
VOLUME /cache
EXPOSE 8000
CMD [".venv/bin/specstream", "serve"]
