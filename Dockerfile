# Halfmoon: one image for every service (`halfmoon serve <service>`).
# CPU torch by default; for CUDA: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HALFMOON_HOME=/data

# A C compiler builds the native paged-attention kernel on first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY services services
COPY shared shared
COPY console console
COPY migrations migrations
RUN pip install --no-cache-dir .

VOLUME ["/data"]
ENTRYPOINT ["halfmoon"]
CMD ["--help"]
