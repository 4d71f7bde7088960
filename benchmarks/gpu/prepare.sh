#!/usr/bin/env bash
# The GPU kit, part 1 (on this machine, with a package registry): everything run.sh needs that
# the GPU machine cannot fetch, into .gpukit/ (git ignores it; a device call carries it).
#
#   bash benchmarks/gpu/prepare.sh [--no-unsloth-check]
#
#   .gpukit/wheels/     benchmarks/gpu/wheels.txt for Python 3.12 on manylinux x86_64
#                       (bitsandbytes slimmed to its CUDA 13 and CPU libraries)
#   .gpukit/peers/      benchmarks/gpu/peer_wheels.txt: Unsloth's own site, for part 3 only
#                       (Unsloth slimmed of its web UI)
#   .gpukit/tokenizer/  SmolLM2's tokenizer and chat template (no weights: models are built there)
#   .gpukit/data/       code_alpaca_2k.json, the rows the benchmarks train on
#
# Both sets are tried with pip's dry run for Python 3.12 there. Then Unsloth is installed for
# this machine's Python into ~/.cache/llmcustoms-dev/unsloth-site-cpu and imported with its CPU
# fallback off: it must fail with Unsloth's no-GPU message (an import that breaks otherwise is
# found here, not on the GPU); the dry run (run.sh --dry-run --part 3) then runs Unsloth's CPU
# backend from that site. It prints what each part's call carries and fails if one is over
# 56 MiB: a device call sends at most 64 MiB. Rerunning it downloads only what is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpukit
LIMIT_MIB=56
PYTHON=${PYTHON:-python3}
UNSLOTH_CHECK=yes
[ "${1:-}" = "--no-unsloth-check" ] && UNSLOTH_CHECK=no
mkdir -p "$KIT/wheels" "$KIT/peers" "$KIT/tokenizer" "$KIT/data"

# 1. Wheels. pip matches a manylinux tag exactly, so every glibc level a wheel may be built for is named.
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done

fetch() {  # fetch LIST DIR: every NAME==VERSION of LIST as a Python 3.12 wheel in DIR, and nothing else there
    local list=$1 dir=$2
    grep -vE '^\s*(#|$)' "$list" | while read -r requirement; do
        name=${requirement%%==*}
        version=${requirement##*==}
        pattern=$(echo "$name" | tr '-' '_')
        if ls "$dir/" 2>/dev/null | grep -qiE "^${pattern}-${version}-"; then
            continue
        fi
        echo "downloading $requirement"
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d "$dir" "$requirement" 2>&1 | grep -v '^WARNING: Location' || true
        ls "$dir/" | grep -qiE "^${pattern}-${version}-" || { echo "prepare.sh: no wheel for $requirement" >&2; exit 1; }
    done
    # Wheels of versions no longer listed would be installed too: two versions of one package stop pip.
    local wanted
    mapfile -t wanted < <(grep -vE '^\s*(#|$)' "$list" | tr '[:upper:]-' '[:lower:]_' | sed 's/==/-/')
    for wheel in "$dir"/*.whl; do
        base=$(basename "$wheel" | tr '[:upper:]' '[:lower:]')
        listed=no
        for prefix in "${wanted[@]}"; do [[ $base == "$prefix"-* ]] && listed=yes; done
        if [ $listed = no ]; then echo "removing $(basename "$wheel") (not in $list)"; rm "$wheel"; fi
    done
}

installs_there() {  # installs_there WHAT WHEEL...: the install run.sh does there, tried here for that Python
    local what=$1 check
    shift
    check=$(mktemp -d)
    if ! "$PYTHON" -m pip install --quiet --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platforms[@]}" --target "$check" "$@" >"$check.log" 2>&1; then
        grep -v '^WARNING: Location' "$check.log" >&2
        echo "prepare.sh: $what would not install on Python 3.12 x86_64 (above)" >&2
        exit 1
    fi
    rm -rf "$check" "$check.log"
}

fetch benchmarks/gpu/wheels.txt "$KIT/wheels"
for wheel in "$KIT"/wheels/bitsandbytes-*.whl; do
    "$PYTHON" benchmarks/gpu/slim_wheel.py "$wheel" 'bitsandbytes/libbitsandbytes_*' --keep '*cuda13*' --keep '*_cpu.so'
done
installs_there "the wheels" "$KIT"/wheels/*.whl
fetch benchmarks/gpu/peer_wheels.txt "$KIT/peers"
for wheel in "$KIT"/peers/unsloth-2*.whl; do
    "$PYTHON" benchmarks/gpu/slim_wheel.py "$wheel" 'studio/*'
done
shared=()
for name in bitsandbytes peft dill multiprocess; do shared+=("$KIT"/wheels/${name}-*.whl); done
installs_there "Unsloth's site" "$KIT"/peers/*.whl "${shared[@]}"

# 2. Unsloth imported here, for this Python: with its CPU fallback off it must say it needs a GPU.
if [ $UNSLOTH_CHECK = yes ]; then
    site=$HOME/.cache/llmcustoms-dev/unsloth-site-cpu
    if [ ! -d "$site/unsloth" ]; then
        echo "installing Unsloth for this machine's Python into $site (once)"
        # transformers and huggingface_hub at the GPU image's versions: Unsloth's pins, not ours.
        grep -vE '^\s*(#|$)' benchmarks/gpu/peer_wheels.txt | xargs "$PYTHON" -m pip install --quiet --no-deps \
            --target "$site" transformers==5.17.0 huggingface_hub==1.33.0 2>&1 | grep -v '^WARNING: Location' || true
        rm -rf "$site/studio"
    fi
    said=$(cd /tmp && UNSLOTH_DISABLE_CPU_FALLBACK=1 PYTHONPATH=$site "$PYTHON" -c 'import unsloth' 2>&1 || true)
    if ! grep -q "You need a GPU" <<<"$said"; then
        echo "$said" | tail -20 >&2
        echo "prepare.sh: importing Unsloth did not end with its no-GPU message (above): its site is broken" >&2
        exit 1
    fi
    echo "Unsloth import check: fails here as it should ($(grep -o 'Unsloth cannot find.*GPU\.' <<<"$said" | head -1))"
fi

# 3. The tokenizer of the real model the benchmarks use (built once, offline, by the shared script).
REAL_MODEL=${REAL_MODEL:-$HOME/.cache/llmcustoms-dev/smollm2-135m-instruct}
if [ ! -f "$REAL_MODEL/tokenizer.json" ]; then
    "$PYTHON" ../shared/tools/make_real_model.py "$REAL_MODEL"
fi
for name in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    [ -f "$REAL_MODEL/$name" ] && cp "$REAL_MODEL/$name" "$KIT/tokenizer/"
done

# 4. The data (../shared does not travel with a device call).
cp ../shared/data/code_alpaca_2k.json "$KIT/data/"

# 5. What each part's call carries: tracked and untracked-not-ignored files, plus its carry paths.
tree_bytes=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true) | awk '{s+=$1} END {print s+0}')
mib() { echo "scale=1; $1 / 1048576" | bc -l; }
printf 'wheels:\n'; ls -s --block-size=K "$KIT/wheels" | tail -n +2 | sed 's/^/  /'
printf "Unsloth's site (part 3):\n"; ls -s --block-size=K "$KIT/peers" | tail -n +2 | sed 's/^/  /'
over=no
for part in 1 2 3; do
    carry=("$KIT/wheels" "$KIT/tokenizer" "$KIT/data")
    [ $part = 3 ] && carry+=("$KIT/peers")
    kit_bytes=$(du -scb "${carry[@]}" | tail -1 | cut -f1)
    total=$(( tree_bytes + kit_bytes ))
    printf 'part %s: tree %s MiB + %s MiB carried = %s MiB (limit %d MiB here, 64 a call); carry: %s\n' \
        "$part" "$(mib "$tree_bytes")" "$(mib "$kit_bytes")" "$(mib "$total")" "$LIMIT_MIB" "${carry[*]}"
    [ $(( total / 1048576 )) -ge "$LIMIT_MIB" ] && over=yes
done
if [ $over = yes ]; then
    echo "prepare.sh: a part's call would carry over $LIMIT_MIB MiB: drop a wheel or slim it" >&2
    exit 1
fi
echo "ready: on the GPU machine run  bash benchmarks/gpu/run.sh OUT_DIR --next  (carry the part's paths above)"
