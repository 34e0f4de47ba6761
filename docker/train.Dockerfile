# syntax=docker/dockerfile:1.7
# Training image: shared_model + lt_plugins (Lightning, DeepSpeed, OmegaConf) and the training configs.
#   docker build -f docker/train.Dockerfile -t tandem-train .                          (CPU, gloo)
#   docker build -f docker/train.Dockerfile --build-arg VARIANT=cuda -t tandem-train:cuda .   (CUDA, nccl)
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# DeepSpeed builds from source: it needs a compiler at install time (not at run time).
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ "$VARIANT" = "cpu" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}"; \
    elif [ "$VARIANT" = "cuda" ]; then \
        pip install "torch==${TORCH_VERSION}"; \
    else echo "VARIANT must be cpu or cuda, got ${VARIANT}" >&2; exit 2; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared_model ./shared_model
COPY tandem_native ./tandem_native
COPY lt_plugins ./lt_plugins
RUN pip install ".[train]"

FROM ${PYTHON_IMAGE} AS runtime
# DeepSpeed compiles its CPU shared-memory collective (deepspeed_shm_comm) on first use with torch's JIT
# extension loader, so the training runtime keeps a C++ compiler (the inference image does not).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home tandem \
 && mkdir -p /runs /bundles && chown tandem:tandem /runs /bundles
COPY --from=builder /opt/venv /opt/venv
COPY --chown=tandem:tandem configs /home/tandem/configs
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp/matplotlib
USER tandem
WORKDIR /home/tandem
ENTRYPOINT ["tandem"]
# /runs is a volume in docker-compose.yml: `tandem train ... run_dir=/runs/NAME` leaves the bundle in /runs/NAME/bundle.
CMD ["train", "--config", "configs/demo.yaml", "run_dir=/runs/demo"]
