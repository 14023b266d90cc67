# syntax=docker/dockerfile:1
# llmflow images, one Dockerfile, two targets (see docs/CLUSTER.md):
#
#   docker build --target gpu -t llmflow:gpu .    # CUDA runtime + CUDA torch: GPU work pools
#   docker build --target cpu -t llmflow:cpu .    # python slim + CPU torch: data steps, CI
#
# Both install llmflow as a package (a wheel built in the first stage) and work in /opt/llmflow,
# where deployments/prefect.yaml (its set_working_directory pull step) and the Kubernetes
# templates expect it: the deployments' entrypoints (flows/deploy.py:run_preset, ...) are files
# under that folder.

ARG PYTHON_VERSION=3.11
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# torch is installed first, from the index matching the target, so pip never pulls a CUDA
# build into the CPU image (or a CPU build into the GPU one).
ARG TORCH_SPEC="torch>=2.6,<2.15"
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_GPU=https://download.pytorch.org/whl/cu128
# The optional extras every recipe in configs/ and every manifest in deployments/ needs: merge
# (mergekit, the SmolLM3 recipes' last step), ray (the KubeRay cluster, pretrain.launcher: ray),
# sweep (Optuna, PostgreSQL studies) and trackers (MLflow, W&B). tests/packaging checks the list.
ARG LLMFLOW_EXTRAS=merge,ray,sweep,trackers

# ---------------------------------------------------------------------------------------------
# build: the llmflow wheel (flows, tasks, model, and the configs/deployments presets as data)
FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY flows/ flows/
COPY tasks/ tasks/
COPY model/ model/
COPY configs/ configs/
COPY deployments/ deployments/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# files: what both targets keep in /opt/llmflow (the deployments' entrypoints, presets, docs)
FROM scratch AS files
WORKDIR /opt/llmflow
COPY flows/ flows/
COPY configs/ configs/
COPY deployments/ deployments/
COPY docs/ docs/
COPY README.md ./

# ---------------------------------------------------------------------------------------------
# cpu: python slim, CPU torch, llmflow
FROM python:${PYTHON_VERSION}-slim AS cpu
ARG TORCH_SPEC
ARG TORCH_INDEX_CPU
ARG LLMFLOW_EXTRAS
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --index-url "${TORCH_INDEX_CPU}" "${TORCH_SPEC}"
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/llmflow-*.whl)[${LLMFLOW_EXTRAS}]" && rm -rf /wheels
WORKDIR /opt/llmflow
COPY --from=files /opt/llmflow /opt/llmflow
RUN llmflow --help > /dev/null && llmflow plan configs/smollm3-135m.yaml > /dev/null
CMD ["llmflow", "--help"]

# ---------------------------------------------------------------------------------------------
# gpu: CUDA runtime, CUDA torch, llmflow (the default target: last stage)
FROM ${CUDA_BASE} AS gpu
ARG TORCH_SPEC
ARG TORCH_INDEX_GPU
ARG LLMFLOW_EXTRAS
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
RUN pip install --index-url "${TORCH_INDEX_GPU}" "${TORCH_SPEC}"
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/llmflow-*.whl)[${LLMFLOW_EXTRAS}]" && rm -rf /wheels
WORKDIR /opt/llmflow
COPY --from=files /opt/llmflow /opt/llmflow
RUN llmflow --help > /dev/null && llmflow plan configs/smollm3-1.7b.yaml > /dev/null
CMD ["llmflow", "--help"]
