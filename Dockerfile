# The project as a container image: what the docker, ECS and Kubernetes work pools run.
#
#   docker build -t retrain-pipeline:latest .                          # CPU torch
#   docker build -t retrain-pipeline:cu126 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#     --build-arg RUNTIME_PACKAGES="gcc libc6-dev python3-dev" .         # CUDA 12.6 torch
#
# Build arguments:
#   BASE_IMAGE       an image with Debian's or Ubuntu's apt; both stages use it, so the virtual
#                    environment built in the first runs unchanged in the second. Where it has no
#                    python3 (>= 3.10) with its venv module (NVIDIA's CUDA images), apt installs
#                    them in both stages.
#   RUNTIME_PACKAGES apt packages the final stage also needs, e.g. a C compiler and the Python
#                    headers for `train.compile` (Triton builds its launcher on a GPU, Inductor its
#                    C++ kernels on a CPU); empty by default, for a smaller image.
#   TORCH_INDEX_URL  where torch comes from: PyTorch's CPU index by default (a 200 MB wheel rather
#                    than PyPI's 4 GB CUDA build), or its index for one CUDA version; empty: the
#                    package index alone (with a torch wheel in docker/build-extras/).
#   EXTRAS           optional extras of the project to install too, e.g. "mlflow".
# Files in docker/build-extras/ reach the first stage only: wheels there are found before any
# index, and a ca-bundle.crt there is the CA bundle pip trusts (a network behind a TLS proxy).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY docker/build-extras/ /tmp/build-extras/
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; fi
RUN python3 -m venv /opt/venv
WORKDIR /opt/retrain
# The dependencies first, from the lock, in a layer of their own: a change to the code reuses it.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir training tasks flows retrain_cli \
    && touch training/__init__.py tasks/__init__.py flows/__init__.py retrain_cli/__init__.py \
    && pip-install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -c constraints.txt ".${EXTRAS:+[$EXTRAS]}"
COPY training/ training/
COPY tasks/ tasks/
COPY flows/ flows/
COPY retrain_cli/ retrain_cli/
RUN pip-install --no-deps -c constraints.txt . \
    && /opt/venv/bin/python -m compileall -q training tasks flows retrain_cli

FROM ${BASE_IMAGE}
ARG RUNTIME_PACKAGES=
# No build tools here unless RUNTIME_PACKAGES asks: the virtual environment and the code are
# copied in whole. The interpreter must be the one the first stage built the venv with.
RUN missing=; python3 -c "import sys" 2>/dev/null || missing="python3"; \
    if [ -n "$missing${RUNTIME_PACKAGES}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $missing ${RUNTIME_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; fi
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin retrain
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=root:root /opt/retrain /opt/retrain
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule
# The deployments' pull step sets this folder as the flow's working directory.
WORKDIR /opt/retrain
USER retrain
CMD ["retrain", "--help"]
