#!/bin/bash
# bench_backends.py on a GPU host that has no Docker engine and no container toolkit (docs/docker.md):
#   ENGINE_TAR=engine.tar.xz WHEELS=wheels/ bash tests/benchmarks/docker_on_gpu_host.sh run --preset llama-1b ...
# ENGINE_TAR: Debian's docker.io, containerd and runc binaries in eng/bin and the libraries they need in eng/lib
# (apt-get download, dpkg -x); WHEELS: cp312 wheels of what lmyard needs that the host's Python lacks (pydantic,
# pydantic-settings, pyyaml, psutil, docker, requests, tqdm, ...) and tiktoken/ (TIKTOKEN_CACHE_DIR).
# It starts dockerd on /tmp/d.sock, imports the host's root as the image `hostroot`, then runs the command.
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
ENGINE_TAR=${ENGINE_TAR:-$R/.whl/gpu/engine.tar.xz}
WHEELS=${WHEELS:-$R/.whl/bench-py312}
export PATH=/tmp/eng/bin:$PATH DOCKER_HOST=unix:///tmp/d.sock
if ! LD_LIBRARY_PATH=/tmp/eng/lib docker info >/dev/null 2>&1; then
  tar -xJf "$ENGINE_TAR" -C /tmp
  LD_LIBRARY_PATH=/tmp/eng/lib setsid /tmp/eng/bin/dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 --data-root=/tmp/dd --exec-root=/tmp/de -H unix:///tmp/d.sock --pidfile /tmp/d.pid > /tmp/dockerd.log 2>&1 < /dev/null &
  for i in $(seq 30); do LD_LIBRARY_PATH=/tmp/eng/lib docker info >/dev/null 2>&1 && break; sleep 1; done
fi
if ! LD_LIBRARY_PATH=/tmp/eng/lib docker image inspect hostroot >/dev/null 2>&1; then
  t=$(date +%s); tar -C / -c --exclude=usr/local bin lib lib64 sbin usr etc 2>/dev/null | LD_LIBRARY_PATH=/tmp/eng/lib docker import - hostroot >/dev/null; echo "image import: $(( $(date +%s)-t )) s"
fi
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl >/dev/null 2>&1
export PYTHONPATH=$R:/tmp/site TIKTOKEN_CACHE_DIR=$WHEELS/tiktoken NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run() {
  python3 $R/tests/benchmarks/bench_backends.py --engine unix:///tmp/d.sock --image hostroot --nodes 2 --node-gpus 0 1 \
    --volume /usr/local:/usr/local:ro --volume /opt:/opt:ro --volume /tmp/site:/tmp/site:ro \
    --env PATH=/opt/torch/.venv/bin:/usr/local/bin:/usr/bin:/bin --env PYTHONPATH=$R:/tmp/site \
    --env TIKTOKEN_CACHE_DIR=$WHEELS/tiktoken --set launch.docker.user=root --set "launch.docker.ulimits={}" "$@"
}
"$@"
