# LoRazor's OpenAI-compatible server. CPU by default:
#   docker build -t lorazor . && docker run -p 8000:8000 lorazor            # the shipped testbed
# GPU: build on an image that has CUDA torch, and install without replacing it:
#   docker build --build-arg BASE=pytorch/pytorch --build-arg TORCH= -t lorazor-gpu .
#   docker run --gpus all -p 8000:8000 -e LORAZOR_API_KEY=... -v /models:/models lorazor-gpu \
#       --model /models/base --lora-modules sql=/models/sql-lora --dtype bfloat16
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
COPY kernels ./kernels
RUN if [ -n "$TORCH" ]; then pip install --no-cache-dir $TORCH; fi \
    && pip install --no-cache-dir ".[serve]"
# Adapters and models mounted under /models; the Hugging Face cache in a volume.
ENV HF_HOME=/cache/huggingface
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["lorazor", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--testbed"]
