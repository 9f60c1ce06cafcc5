#!/usr/bin/env bash
# On the GPU machine, from the repository root with .gpu/ carried (bench/gpu-carry.sh):
# our dependencies from wheels beside the machine's torch, then Kafka and
# Redis on loopback with the project's own scripts. Then runs "$@".
set -euo pipefail
cd "$(dirname "$0")/.."
# The machine's Python environment already has torch: add our dependencies to it
# (the machine is a throwaway; a nested venv would not see its packages).
if [ ! -f /tmp/conveyor-deps-installed ]; then
  python3 -c "import torch, torchvision" || { echo "no torch on this machine's python3" >&2; exit 1; }
  python3 -m pip install -q --no-index --find-links .gpu/wheels \
    aiokafka redis hiredis uvloop google-crc32c pydantic pydantic-settings orjson prometheus-client py-spy \
    "setuptools>=77" wheel
  # --quantize int8, when the call carries .gpu-extra/; everything else is served without it.
  if ls .gpu-extra/torchao-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps .gpu-extra/torchao-*.whl
  else
    echo "no .gpu-extra/ carried: --quantize int8 will refuse to start" >&2
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  touch /tmp/conveyor-deps-installed
fi
if [ ! -d /tmp/jre0 ]; then
  tar -C /tmp -xJf .gpu/jre0.tar.xz
  mkdir -p /tmp/redis && for deb in .gpu/debs/*.deb; do dpkg -x "$deb" /tmp/redis; done
  version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' compose/local/kafka-pom.xml)
  mkdir -p ".cache/kafka-$version" && rm -rf ".cache/kafka-$version/libs"
  tar -C /tmp -xJf .gpu/kafka0.tar.xz && mv /tmp/kafka0 ".cache/kafka-$version/libs"
  # The marker fetch-kafka.sh expects: the checksum of the POM the jars answer to.
  sha256sum compose/local/kafka-pom.xml | cut -d" " -f1 >".cache/kafka-$version/libs/.complete"
fi
export PATH="/tmp/jre0/bin:/tmp/redis/usr/bin:$PATH"
# nvImageCodec (decode=gpu-hw), trimmed by gpu-carry.sh; CUDA's own libnvjpeg serves it.
[ -d /tmp/nvimgcodec ] || tar -C /tmp -xJf .gpu/nvimgcodec.tar.xz
export PYTHONPATH="/tmp/nvimgcodec${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="/tmp/redis/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
# The broker's log in memory and a larger heap: a run appends tens of GB at up to
# 800 MB/s, and the lent machine's disk is not what is being measured.
if [ "${CONVEYOR_BENCH_KAFKA_IN_MEMORY:-1}" = 1 ] && [ ! -e .run/kafka-9092/data ]; then
  mkdir -p /dev/shm/conveyor-kafka-data .run/kafka-9092
  ln -s /dev/shm/conveyor-kafka-data .run/kafka-9092/data
fi
export KAFKA_HEAP=${KAFKA_HEAP:-"-Xms4g -Xmx4g"}
compose/local/up.sh
"$@"
