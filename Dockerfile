# One image for every pipellm service: compose.yaml runs it as gateway, tokenizer, compute and
# detokenizer (`pipellm service <name>`); alone, `docker run --gpus all -p 8000:8000 IMAGE` runs
# `pipellm serve` (embedded Redis and all four services in one container).
FROM python:3.11-slim

# gcc and the libc headers: Triton compiles its small CUDA launcher with the C compiler at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIPELLM_DEMO_DIR=/opt/pipellm/demo-llama

WORKDIR /app

# torch first and pinned, as services/setup.sh installs it, but PyPI's default build: on Linux
# x86_64 that is the CUDA build (with its nvidia-* libraries and triton), not the CPU index's.
RUN pip install torch==2.13.0

# The other dependencies, read from pyproject.toml alone, so that this layer survives source edits.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself (pyproject.toml packages services, shared, kernels, loadgen).
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY loadgen ./loadgen
RUN pip install --no-deps .

# The built-in demo model, built once here at $PIPELLM_DEMO_DIR, so that every container of this
# image (every service) reads the very same files instead of each building its own at start-up.
RUN python -c "from shared.demo_model import ensure_demo_model; print(ensure_demo_model())"

RUN useradd --create-home --uid 1000 pipellm
USER pipellm

EXPOSE 8000
CMD ["pipellm", "serve", "--host", "0.0.0.0"]
