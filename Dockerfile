# One image for every pdserve role; the role is the command: `gateway`, `prefill-worker`, `decode-worker`,
# `fetch-model`, `certs`, `health HOST:PORT`.
#
# CPU by default (torch from the pytorch.org CPU-only index). docker-compose.yml's `gpu` profile builds the CUDA
# variant with TORCH_INDEX=https://pypi.org/simple (PyPI's Linux x86_64 torch wheels are the CUDA build, with the
# CUDA libraries as nvidia-* wheels, so no CUDA base image is needed) and PDSERVE_EXTRAS=gpu (Triton).
#
# The model is not baked in: `pdserve fetch-model` downloads it into $PDSERVE_HOME/models, a volume.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# Comma-separated extras of the pdserve distribution, e.g. "gpu".
ARG PDSERVE_EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles a small C launcher the first time it runs a kernel, so the GPU variant needs a C compiler
# (Python's headers are already in this image).
RUN case ",${PDSERVE_EXTRAS}," in \
      *,gpu,*) apt-get update \
               && apt-get install -y --no-install-recommends gcc libc6-dev \
               && rm -rf /var/lib/apt/lists/* ;; \
    esac

# torch first, from its own index, in its own layer: the largest download, and it rarely changes.
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

# The remaining dependencies come from pyproject.toml alone, so editing the source does not reinstall them.
# torch is already there in the accepted range, so pip keeps the build installed above.
WORKDIR /opt/pdserve/src
COPY pyproject.toml ./
RUN python -c 'import os, tomllib; \
project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in os.environ.get("PDSERVE_EXTRAS", "").split(",") if e]; \
print("\n".join(project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]))' \
      > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . && pip check

# Runs as an unprivileged user. /models and the /pki folders are created here, owned by that user, so a fresh
# named volume mounted there starts with the same owner: `pdserve fetch-model` can write the model, and
# `pdserve certs --compose /pki` each service's keys (0700 folders, 0600 keys).
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models /pki/gateway /pki/prefill /pki/decode /pki/redis \
    && chown pdserve:pdserve /models /pki/gateway /pki/prefill /pki/decode /pki/redis \
    && chmod 0700 /pki/gateway /pki/prefill /pki/decode /pki/redis
ENV PDSERVE_HOME=/models
USER pdserve
WORKDIR /home/pdserve

# gateway 50051 (gRPC) and 8000 (OpenAI HTTP), prefill workers 50061, decode workers 50071, each server's
# health-only port 8081 and metrics port 9090 (the ports docker-compose.yml and deploy/k8s use).
EXPOSE 50051 8000 50061 50071 8081 9090
ENTRYPOINT ["pdserve"]
CMD ["--help"]
