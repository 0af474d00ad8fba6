FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml Makefile README.md ./
COPY specstream specstream
COPY gateway gateway
COPY clients clients
# CPU torch by default (PyTorch's CPU wheel index: a few hundred MB instead of the CUDA
# build). For a GPU image: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
RUN python -m venv .venv && .venv/bin/pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX"
RUN make setup SETUP_NGINX=0
ENV SPECSTREAM_CACHE_DIR=/cache SPECSTREAM_HOST=0.0.0.0
VOLUME /cache
EXPOSE 8000
CMD [".venv/bin/specstream", "serve"]
