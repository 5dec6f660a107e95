# kv-preflight: one image for ingester, predictor, simulator and the index CLI.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kv_preflight kv_preflight
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "from kv_preflight.keys.chain import HAS_C_EXTENSION; assert HAS_C_EXTENSION"
# numeric, so Kubernetes can check runAsNonRoot (a user name cannot be checked without the image's passwd)
USER 65534:65534
ENTRYPOINT ["kv-preflight"]
CMD ["--help"]
