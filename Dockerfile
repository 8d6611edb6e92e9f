# One image for `batchpilot serve` and `batchpilot operator`.
#   docker build -t batchpilot:0.1.0 .                                   # CPU torch
#   docker build -t batchpilot:0.1.0-cuda \
#     --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" .
# The CUDA wheels carry their own CUDA runtime; the node supplies the driver
# (NVIDIA container toolkit / device plugin), so the slim base serves both.
# Never built where this repository was made (no Docker engine there); what the build
# stage COPYs is what tests/integration/test_install.py installs into a fresh virtualenv.
# The manifests name the image once: manifests/base/kustomization.yaml (`make kind-load`).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
# Always pinned: an unpinned `torch` pulls a multi-GB CUDA build.
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: it changes far less often than the code.
RUN pip install ${TORCH_SPEC}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY operator ./operator
COPY tools ./tools
RUN pip install . && python -c "import batchpilot_server, batchpilot_operator, batchpilot_tools, torch"
# The native paged-attention kernel (batchpilot_server/engine/csrc), built here because
# the runtime image has no compiler. Its x86-64 build carries AVX-512, AVX2 and
# baseline versions and picks one at load time, so the image runs on any node.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && XDG_CACHE_HOME=/opt/venv/cache python -c \
    "from batchpilot_server.engine.attention_kernel_build import paged_decode_kernel; paged_decode_kernel()"

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 batchpilot \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin batchpilot
COPY --from=build /opt/venv /opt/venv
# HOME=/tmp: the pods run with a read-only root filesystem and an emptyDir on /tmp.
# XDG_CACHE_HOME: where the kernel built above lies (read-only is enough).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/opt/venv/cache
USER 10001:10001
# 8000: `batchpilot serve`; 8080: the operator's liveness endpoint.
EXPOSE 8000 8080
ENTRYPOINT ["batchpilot"]
CMD ["--help"]
