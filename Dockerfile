# Three images from one file; compose.yaml builds the first two, compose.scale.yaml the last two:
#   slim     the gateway, tokenizer and detokenizer (`pipellm service <name>`): no torch
#   compute  slim plus torch, Triton and a C compiler: compute, or the whole server alone
#            (`docker run -p 8000:8000 IMAGE` runs `pipellm serve`, embedded Redis included)
#   router   vllm-router (a prebuilt binary from the package index), in front of replicas
# Both carry the default model, SmolLM2-135M-Instruct, fetched at build time into
# $PIPELLM_DEFAULT_MODEL_DIR, so that every container reads the very same file.
#
# Which torch compute carries is a build argument. The default, PyPI's torch==2.13.0, is on
# Linux x86_64 the CUDA 13.0 build: it runs on any machine, and on an NVIDIA GPU with a driver
# of the 580 series or newer (compose.gpu.yaml). A CPU-only image (about a tenth of the size):
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# or, without that index, a CPU torch wheel put in ./wheels (wheels there are preferred: a local
# version such as 2.13.0+cpu sorts above PyPI's 2.13.0).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=

FROM python:3.11-slim AS slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIPELLM_DEFAULT_MODEL_DIR=/opt/pipellm/models

WORKDIR /app

# The base dependencies, read from pyproject.toml alone, so that this layer survives source edits.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself (the pipellm package), then the model.
COPY pipellm ./pipellm
# /app's copy goes once installed: every process imports the installed package, whose
# kernel sources are the paths compute's image built its kernels from
RUN pip install --no-deps . && python -m pipellm.shared.default_model \
    && rm -rf pipellm

RUN useradd --create-home --uid 1000 pipellm
USER pipellm
EXPOSE 8000


FROM slim AS compute

USER root
# gcc, g++ and the libc headers: the C++ CPU kernels (pipellm/kernels/cpu) are built with them below, and
# Triton compiles its small CUDA launcher with gcc at run time. torch's extension headers include
# Python.h: Debian's libpython3-dev brings it where the base image's Python has no headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev $(python -c \
        "import os, sysconfig; print('' if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 'libpython3-dev')") \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_SPEC
ARG TORCH_INDEX_URL
# `wheel[s]` copies the wheels in ./wheels when there is one, and nothing otherwise
COPY pyproject.toml wheel[s] /tmp/build/
RUN pip install --find-links /tmp/build \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['compute']))" \
        > /tmp/requirements.txt \
    && pip install --find-links /tmp/build -r /tmp/requirements.txt \
    && rm -rf /tmp/requirements.txt /tmp/build
USER pipellm
# The C++ CPU kernels built once, into the image: one build for every x86 CPU from AVX2 up (the
# level is chosen at start-up), so a container loads them in a second instead of compiling for
# minutes. Built from the installed package: the sources' paths are those compute loads at run
# time (`pipellm service compute` and `pipellm serve`'s children alike), or ninja would compile
# them all again.
ENV TORCH_EXTENSIONS_DIR=/home/pipellm/.cache/torch_extensions
RUN cd /tmp && python -m pipellm.kernels.cpu
CMD ["pipellm", "serve", "--host", "0.0.0.0"]


FROM python:3.11-slim AS router

# the version tests/test_router.py checks (scripts/setup.sh installs it for the tests)
RUN pip install --no-cache-dir --disable-pip-version-check vllm-router==0.1.17 \
    && useradd --create-home --uid 1000 router
USER router
EXPOSE 8000
CMD ["vllm-router", "--host", "0.0.0.0", "--port", "8000"]
