#!/usr/bin/env bash
# Build .gpu/: what the GPU machine lacks (it has torch but no Java, Redis or our
# pure-Python dependencies, and no network), small enough to carry (< 64 MiB).
# Kafka's jars and a jlink'd Java runtime are repacked uncompressed and then xz'd:
# xz on raw class files is about half the size of the jars' own deflate.
set -euo pipefail
cd "$(dirname "$0")/.."
# .gpu-extra/ carries the transformers of this checkout's venv.
[ -x .venv/bin/python ] || { echo "bench/gpu-carry.sh: no .venv here; run make install first" >&2; exit 1; }
out=.gpu
extra=.gpu-extra
rm -rf "$out" "$extra" && mkdir -p "$out/wheels" "$out/debs" "$extra"
python3 -m pip download -q -d "$out/wheels" --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  aiokafka redis hiredis uvloop google-crc32c pydantic pydantic-settings orjson prometheus-client py-spy \
  "setuptools>=77" wheel
# nvImageCodec (the hardware JPEG engine) for Python 3.12 only: its wheel carries builds for
# every Python and codecs Conveyor does not use, 70 MB unpacked; the part used is ~14 MB.
# No nvidia/__init__.py: "nvidia" stays a namespace package shared with torch's CUDA libraries.
python3 -m pip download -q --no-deps -d "$out/nvimg-wheel" --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 nvidia-nvimgcodec-cu13
mkdir -p "$out/nvimgcodec"
unzip -q "$out"/nvimg-wheel/*.whl -d "$out/nvimg-all"
mkdir -p "$out/nvimgcodec/nvidia/nvimgcodec/extensions"
cp "$out"/nvimg-all/nvidia/nvimgcodec/__init__.py "$out"/nvimg-all/nvidia/nvimgcodec/libnvimgcodec.so.0 \
  "$out"/nvimg-all/nvidia/nvimgcodec/nvimgcodec_impl.cpython-312-x86_64-linux-gnu.so \
  "$out/nvimgcodec/nvidia/nvimgcodec/"
cp "$out"/nvimg-all/nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.* \
  "$out"/nvimg-all/nvidia/nvimgcodec/extensions/libjpeg_turbo_ext.so.* \
  "$out/nvimgcodec/nvidia/nvimgcodec/extensions/"
rm -rf "$out/nvimg-all" "$out/nvimg-wheel"
# xz takes its 14 MB to 2.3.
tar -C "$out" -cf - nvimgcodec | xz -9 -T2 >"$out/nvimgcodec.tar.xz" && rm -rf "$out/nvimgcodec"
(cd "$out/debs" && apt-get download redis-server redis-tools libjemalloc2 liblzf1)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The broker alone (no tools), without zstd or snappy: Conveyor's records are uncompressed.
mvn -B -q -f bench/kafka-broker-pom.xml dependency:copy-dependencies -DincludeScope=runtime \
  -DoutputDirectory="$work/jars"
mkdir "$work/kafka0"
for jar in "$work"/jars/*.jar; do
  case $(basename "$jar") in zstd-jni-*|snappy-java-*) continue ;; esac
  mkdir "$work/x" && (cd "$work/x" && unzip -q "$jar" && zip -q -0 -r -X "$work/kafka0/$(basename "$jar")" .) && rm -rf "$work/x"
done
tar -C "$work" -cf - kafka0 | xz -9 -T2 >"$out/kafka0.tar.xz"
jlink --add-modules java.base,java.desktop,java.management,java.naming,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.unsupported,jdk.management,java.instrument,java.scripting,jdk.crypto.ec,java.logging,jdk.zipfs \
  --strip-debug --no-header-files --no-man-pages --compress=0 --output "$work/jre0"
tar -C "$work" -cf - jre0 | xz -9 -T2 >"$out/jre0.tar.xz"

# .gpu-extra/: what only some calls need, carried beside .gpu/ when they do (the tree and
# .gpu/ together are near the 64 MiB a call carries).
# torchao for --quantize int8: 0.18.0 is the release built for torch 2.11, the card's. One
# abi3 wheel, 3.4 MB, with no dependencies of its own (it uses the machine's torch).
python3 -m pip download -q --no-deps -d "$extra" --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 torchao==0.18.0
# transformers for generation (the card has 5.17; the engine's options need 5.18, the hf
# extra's floor): the version this checkout's venv has. The card's own huggingface_hub,
# tokenizers, safetensors and regex meet its requirements. Trimmed to the model families
# the benches load (bench.generate's configs): the others are most of the wheel. On the card:
#   mkdir -p /tmp/tfx && tar -C /tmp/tfx -xJf .gpu-extra/transformers.tar.xz
#   PYTHONPATH=/tmp/tfx/transformers bench/gpu-remote.sh python3 -m bench.generate ...
tf=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
mkdir -p "$work/tfw" "$work/transformers"
python3 -m pip download -q --no-deps -d "$work/tfw" --only-binary=:all: "transformers==$tf"
for whl in "$work"/tfw/*.whl; do unzip -q -o "$whl" -d "$work/transformers"; done
keep=" auto llama gpt2 qwen2 qwen3 mistral "
for dir in "$work"/transformers/transformers/models/*/; do
  name=$(basename "$dir")
  case "$keep" in *" $name "*) ;; *) rm -rf "$dir" ;; esac
done
find "$work/transformers" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work" -cf - transformers | xz -9 -T2 >"$extra/transformers.tar.xz"
du -sh "$out" "$extra"
