# The project as a container image: what the docker, ECS and Kubernetes work pools run.
#
#   docker build -t retrain-pipeline:latest .                          # CPU torch
#   docker build -t retrain-pipeline:cu126 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .   # CUDA 12.6 torch
#
# Build arguments:
#   BASE_IMAGE       an image with python3 (>= 3.10) and its venv module; both stages use it, so the
#                    virtual environment built in the first runs unchanged in the second.
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
# No compilers or build tools here: the virtual environment and the code are copied in whole.
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
