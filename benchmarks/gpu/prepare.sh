#!/usr/bin/env bash
# The GPU kit, part 1 (on this machine, with a package registry): everything run.sh needs that
# the GPU machine cannot fetch, into .gpukit/ (git ignores it; a device call carries it).
#
#   bash benchmarks/gpu/prepare.sh
#
#   .gpukit/wheels/     benchmarks/gpu/wheels.txt for Python 3.12 on manylinux x86_64
#                       (bitsandbytes slimmed to its CUDA 13 and CPU libraries)
#   .gpukit/tokenizer/  SmolLM2's tokenizer and chat template (no weights: models are built there)
#   .gpukit/data/       code_alpaca_2k.json, the rows the benchmarks train on
#
# It prints what will travel (the tree plus .gpukit) and fails if that is over 48 MiB: a
# device call sends at most 64 MiB. Rerunning it downloads only what is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpukit
LIMIT_MIB=48
PYTHON=${PYTHON:-python3}
mkdir -p "$KIT/wheels" "$KIT/tokenizer" "$KIT/data"

# 1. Wheels. pip matches a manylinux tag exactly, so every glibc level a wheel may be built for is named.
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
grep -vE '^\s*(#|$)' benchmarks/gpu/wheels.txt | while read -r requirement; do
    name=${requirement%%==*}
    version=${requirement##*==}
    pattern=$(echo "$name" | tr '-' '_')
    if ls "$KIT/wheels/" 2>/dev/null | grep -qiE "^${pattern}-${version}-"; then
        continue
    fi
    echo "downloading $requirement"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$KIT/wheels" "$requirement" 2>&1 | grep -v '^WARNING: Location' || true
    ls "$KIT/wheels/" | grep -qiE "^${pattern}-${version}-" || { echo "prepare.sh: no wheel for $requirement" >&2; exit 1; }
done
# Wheels of versions no longer listed would be installed too: two versions of one package stop pip.
mapfile -t wanted < <(grep -vE '^\s*(#|$)' benchmarks/gpu/wheels.txt | tr '[:upper:]-' '[:lower:]_' | sed 's/==/-/')
for wheel in "$KIT"/wheels/*.whl; do
    base=$(basename "$wheel" | tr '[:upper:]' '[:lower:]')
    listed=no
    for prefix in "${wanted[@]}"; do [[ $base == "$prefix"-* ]] && listed=yes; done
    if [ $listed = no ]; then echo "removing $(basename "$wheel") (not in wheels.txt)"; rm "$wheel"; fi
done
for wheel in "$KIT"/wheels/bitsandbytes-*.whl; do
    "$PYTHON" benchmarks/gpu/slim_wheel.py "$wheel" 'bitsandbytes/libbitsandbytes_*' --keep '*cuda13*' --keep '*_cpu.so'
done

# The install run.sh does there, tried here for that Python and platform: a wheel of the wrong tag fails now.
check=$(mktemp -d)
if ! "$PYTHON" -m pip install --quiet --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" --target "$check" "$KIT"/wheels/*.whl >"$check.log" 2>&1; then
    grep -v '^WARNING: Location' "$check.log" >&2
    echo "prepare.sh: the wheels would not install on Python 3.12 x86_64 (above)" >&2
    exit 1
fi
rm -rf "$check" "$check.log"

# 2. The tokenizer of the real model the benchmarks use (built once, offline, by the shared script).
REAL_MODEL=${REAL_MODEL:-$HOME/.cache/llmcustoms-dev/smollm2-135m-instruct}
if [ ! -f "$REAL_MODEL/tokenizer.json" ]; then
    "$PYTHON" ../shared/tools/make_real_model.py "$REAL_MODEL"
fi
for name in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    [ -f "$REAL_MODEL/$name" ] && cp "$REAL_MODEL/$name" "$KIT/tokenizer/"
done

# 3. The data (../shared does not travel with a device call).
cp ../shared/data/code_alpaca_2k.json "$KIT/data/"

# 4. What travels: tracked and untracked-not-ignored files, plus the carried .gpukit.
tree_bytes=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true) | awk '{s+=$1} END {print s+0}')
kit_bytes=$(du -sb "$KIT" | cut -f1)
total_mib=$(( (tree_bytes + kit_bytes) / 1048576 ))
printf 'wheels:\n'; ls -s --block-size=K "$KIT/wheels" | tail -n +2 | sed 's/^/  /'
printf 'tree %.1f MiB + .gpukit %.1f MiB = %d MiB to travel (limit %d MiB here, 64 MiB a call)\n' \
    "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$kit_bytes / 1048576" | bc -l)" "$total_mib" "$LIMIT_MIB"
if [ "$total_mib" -gt "$LIMIT_MIB" ]; then
    echo "prepare.sh: $total_mib MiB would travel, over $LIMIT_MIB MiB: drop a wheel or slim it" >&2
    exit 1
fi
echo "ready: on the GPU machine run  bash benchmarks/gpu/run.sh OUT_DIR  (carry .gpukit)"
