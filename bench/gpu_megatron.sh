#!/usr/bin/env bash
# Megatron with Transformer Engine on a CUDA machine (H100/H200): wheels in, TE's torch binding built, bench/gpu_megatron.py run.
#
# A CUDA machine with python3 3.12, torch 2.11 + CUDA 13 and transformers but no package index lacks
# megatron-core, Transformer Engine and pydantic. They come as staged files, at most 64 MiB per copy: the TE
# core wheel (transformer-engine-cu13 2.11.0, 171 MiB) in three parts, and TE's torch binding, which PyPI
# ships only as source (transformer-engine-torch, 240 kB), compiled on the machine against its torch.
# TE 2.11 is the newest inside megatron-core 0.16's tested range (>= 2.9, < 2.12).
#
# With the package index reachable from the GPU machine, one step (from the repository root):
#        OUT=gpu-results bash bench/gpu_megatron.sh online
#
# Without it (run from the repository root):
#   1. on a machine with the index, once:   bash bench/gpu_megatron.sh stage
#        -> .gpu-stage/1, .gpu-stage/2: TE core parts; .gpu-stage/3: the last part, the small wheels, the TE
#           torch source, checksums (.gpu-stage/ is listed in .git/info/exclude: copy it to the GPU machine with the tree)
#   2. on the machine with the GPU, one after the other:
#        bash bench/gpu_megatron.sh receive 1
#        bash bench/gpu_megatron.sh receive 2
#        OUT=gpu-results bash bench/gpu_megatron.sh run
#      `run` prints the table and writes table.txt, results.json and setup.log to $OUT. If the stage in /tmp
#      was lost between steps, `run` says which parts are missing: repeat from `receive 1`.
#   `bash bench/gpu_megatron.sh --help` prints this header.
set -euo pipefail

TE_VERSION=2.11.0
MCORE_VERSION=0.16.1
TE_WHEEL="transformer_engine_cu13-${TE_VERSION}-py3-none-manylinux_2_28_x86_64.whl"
DEVICE_STAGE=/tmp/twinkle-gpu-stage   # kept on the GPU machine between the receive and run steps
SITE=/tmp/twinkle-site
PART_BYTES=$((60 * 1024 * 1024))      # each part fits a 64 MiB copy along with the working tree

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

stage() {
  local py="${PYTHON:-.venv/bin/python}"
  [ -x "$py" ] || py=python3
  mkdir -p .git/info && touch .git/info/exclude
  grep -qxF '/.gpu-stage/' .git/info/exclude || echo '/.gpu-stage/' >> .git/info/exclude
  rm -rf .gpu-stage && mkdir -p .gpu-stage/1 .gpu-stage/2 .gpu-stage/3 .gpu-stage/download
  local pydantic core
  pydantic=$("$py" -c 'import importlib.metadata as m; print(m.version("pydantic"))')
  core=$("$py" -c 'import importlib.metadata as m; print(m.version("pydantic_core"))')
  local wheel_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
                    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
                    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  "$py" -m pip download -q "${wheel_args[@]}" -d .gpu-stage/3 "megatron-core==${MCORE_VERSION}" \
    "pydantic==${pydantic}" "pydantic-core==${core}" annotated-types typing-inspection importlib-metadata
  "$py" -m pip download -q "${wheel_args[@]}" -d .gpu-stage/download "transformer-engine-cu13==${TE_VERSION}"
  # The torch binding's setup.py reads torch.version.cuda even to write its metadata; a CPU torch has None.
  local fake_cuda
  fake_cuda=$(mktemp -d)
  echo "import torch.version; torch.version.cuda = torch.version.cuda or '13.0'" > "$fake_cuda/sitecustomize.py"
  PYTHONPATH="$fake_cuda" "$py" -m pip download -q --no-deps --no-build-isolation -d .gpu-stage/3 \
    "transformer-engine-torch==${TE_VERSION}"
  rm -rf "$fake_cuda"
  (cd .gpu-stage/download && sha256sum "$TE_WHEEL" > ../3/te.sha256 && split -b "$PART_BYTES" -d -a 1 "$TE_WHEEL" te.part-)
  mv .gpu-stage/download/te.part-0 .gpu-stage/1/ && mv .gpu-stage/download/te.part-1 .gpu-stage/2/
  mv .gpu-stage/download/te.part-2 .gpu-stage/3/ && rm -rf .gpu-stage/download
  du -sh .gpu-stage/1 .gpu-stage/2 .gpu-stage/3
}

receive() {
  mkdir -p "$DEVICE_STAGE"
  cp ".gpu-stage/$1/"* "$DEVICE_STAGE/"
  ls -la "$DEVICE_STAGE"
}

install_wheels() (  # a subshell: its directory changes stay inside; each step says when it fails
  mkdir -p "$DEVICE_STAGE" && cp .gpu-stage/3/* "$DEVICE_STAGE/" && cd "$DEVICE_STAGE" || exit 1
  for part in te.part-0 te.part-1 te.part-2; do
    [ -f "$part" ] || { echo "missing $part: the stage in /tmp was lost between steps; repeat from 'receive 1'"; exit 1; }
  done
  cat te.part-0 te.part-1 te.part-2 > "$TE_WHEEL" && sha256sum -c te.sha256 || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ./*.whl \
    || exit 1
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
  # TE's torch binding: compiled against this machine's torch (a CppExtension of ~30 files, MAX_JOBS at once)
  NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=16 timeout 240 python3 -m pip wheel -q --no-deps --no-build-isolation \
    --no-index -w built "transformer_engine_torch-${TE_VERSION}.tar.gz" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" built/*.whl || exit 1
)

run() {
  local started out log
  started=$(date +%s)
  out="${OUT:-bench-out}"
  mkdir -p "$out"
  log="$out/setup.log"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log"
  if [ "${1:-}" = online ]; then  # the package index is reachable: TE builds its torch binding in pip
    python3 -m pip install -q "megatron-core==${MCORE_VERSION}" "transformer-engine[pytorch]==${TE_VERSION}" pydantic \
      >> "$log" 2>&1 || { echo "setup failed (tail of $log):"; tail -25 "$log"; }
  elif ! install_wheels >> "$log" 2>&1; then
    echo "setup failed (tail of $log):"; tail -25 "$log"
  fi
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
  python3 -c 'import megatron.core, torch; print("megatron-core", megatron.core.__version__, "torch", torch.__version__)' \
    2>&1 | tee -a "$log" || true
  python3 -c 'import transformer_engine.pytorch as te, transformer_engine; print("transformer-engine", transformer_engine.__version__)' \
    2>&1 | tail -3 | tee -a "$log" || echo "Transformer Engine does not import: the TE rows will say why"
  echo "setup took $(( $(date +%s) - started )) s"
  # the whole command stays under 8 minutes: the bench gets what the set-up left of 460 s
  PYTHONUNBUFFERED=1 python3 bench/gpu_megatron.py --out "$out" --budget-s $(( 460 - ($(date +%s) - started) ))
}

case "${1:-}" in
  stage) stage ;;
  receive) receive "${2:?receive needs the part number: 1 or 2}" ;;
  run) run ;;
  online) run online ;;
  -h|--help|"") usage ;;
  *) echo "unknown step '$1'"; usage; exit 2 ;;
esac
