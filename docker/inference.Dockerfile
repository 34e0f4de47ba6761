# syntax=docker/dockerfile:1.7
# Inference service image: shared_model + inference_svc only. No Lightning, no DeepSpeed, no OmegaConf.
# It also runs `tandem bench` (the load generator) and `python -m inference_svc.healthcheck`.
#   docker build -f docker/inference.Dockerfile -t tandem-inference .                      (CPU)
#   docker build -f docker/inference.Dockerfile --build-arg VARIANT=cuda -t tandem-inference:cuda .
# VARIANT=cpu installs the CPU build of torch; VARIANT=cuda installs the default (CUDA) build, whose CUDA runtime
# comes as pip packages, so one pinned Python base serves both (the GPU driver comes from the container runtime).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
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
COPY inference_svc ./inference_svc
COPY proto ./proto
RUN pip install ".[serve]" \
 && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('lightning', 'deepspeed')))"

FROM ${PYTHON_IMAGE} AS runtime
# g++: `--compile auto` (the default) builds the compiled decode step with inductor's C++ backend at start-up, and
# tandem_native/loader.py builds Tandem's CPU kernels (with ninja, from the serve extras) at the first start;
# without a compiler the service still runs, eagerly and on torch's kernels, and says so in its log.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home tandem
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp/matplotlib
USER tandem
WORKDIR /home/tandem
# Tandem's CPU kernels into ~/.cache/tandem (where the build machine has AVX-512; else they build at first start)
RUN python -m tandem_native
EXPOSE 50051 8000 9464
STOPSIGNAL SIGTERM
# grpc.health.v1 on the default port; docker-compose.yml sets its own with the configured port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=6 \
    CMD ["python", "-m", "inference_svc.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "/runs/demo/bundle", "--host", "0.0.0.0"]
