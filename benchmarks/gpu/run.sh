#!/usr/bin/env bash
# The GPU kit, part 2 (on the GPU machine): every GPU claim measured in one call, inside a budget.
#
#   bash benchmarks/gpu/run.sh OUT_DIR --next [--budget SECONDS]       on a GPU, after prepare.sh: the part
#                                                                     whose tables are missing or oldest
#   bash benchmarks/gpu/run.sh OUT_DIR [--part 1|2|3] [--only STEP ...] a part by number
#   bash benchmarks/gpu/run.sh --dry-run OUT_DIR [--part 3]            here, on a CPU, tiny shapes
#
# Installs the wheels prepare.sh put in .gpukit/wheels into a temporary site (the machine has no
# registry; --no-deps: wheels.txt names every package); for part 3 also Unsloth's own site from
# .gpukit/peers (its pins differ from ours: peer_wheels.txt). Then runs benchmarks/gpu/kit.py, which
# prints its plan (each step's time cap, the budget: 380 s a part by default, one part a call;
# --next picks it with benchmarks/gpu/schedule.py), writes OUT_DIR/steps/STEP.json,
# OUT_DIR/logs/STEP.log, OUT_DIR/kit.json and OUT_DIR/summary.md after every step, and ends
# inside the budget. A step that fails is recorded and the next one runs. The dry run installs
# nothing: it uses this machine's environment (the project's own venv).
set -uo pipefail
cd "$(dirname "$0")/../.."
started=$(date +%s.%N)
dry_run=no
part=""
args=()
previous=""
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry_run=yes
    [ "$previous" = "--part" ] && part=$arg
    if [ "$arg" = "--next" ]; then
        part=$(python3 benchmarks/gpu/schedule.py) || exit 1
        args+=(--part "$part")
    else
        args+=("$arg")
    fi
    previous=$arg
done

if [ $dry_run = yes ]; then
    PYTHON=${PYTHON:-python}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    PYTHON=${PYTHON:-python3}
    if ! ls .gpukit/wheels/*.whl >/dev/null 2>&1; then
        echo "run.sh: no wheels in .gpukit/wheels: run 'bash benchmarks/gpu/prepare.sh' on the machine with a registry, and carry .gpukit" >&2
        exit 2
    fi
    SITE=${KIT_SITE:-/tmp/llmcustoms-kit-site}
    log=$(mktemp)
    if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .gpukit/wheels/*.whl >"$log" 2>&1; then
        cat "$log" >&2
        echo "run.sh: the carried wheels did not install (above); nothing was measured" >&2
        exit 1
    fi
    if [[ ",$part," == *",3,"* ]]; then
        # Unsloth's own site: its wheels and the ones it shares with ours; the image's transformers 5.17.
        export UNSLOTH_SITE=${KIT_UNSLOTH_SITE:-/tmp/llmcustoms-unsloth-site}
        shared=()
        for name in bitsandbytes peft dill multiprocess; do shared+=(.gpukit/wheels/${name}-*.whl); done
        if ! ls .gpukit/peers/*.whl >/dev/null 2>&1 || ! "$PYTHON" -m pip install --quiet --no-index --no-deps \
                --no-compile --no-cache-dir --upgrade --target "$UNSLOTH_SITE" .gpukit/peers/*.whl "${shared[@]}" \
                >"$log" 2>&1; then
            cat "$log" >&2
            echo "run.sh: Unsloth's wheels (.gpukit/peers) did not install: part 3 runs without Unsloth" >&2
            unset UNSLOTH_SITE
        fi
    fi
    # The carried wheels first (transformers 5.24 over the image's), then the project itself from this tree.
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export KIT_STARTED=$started PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" benchmarks/gpu/kit.py "${args[@]}"
