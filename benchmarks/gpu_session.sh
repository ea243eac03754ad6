#!/usr/bin/env bash
# Every GPU measurement autoplan makes, in one run on a CUDA machine; each section under its own time
# limit, so one that hangs or fails costs only its own limit; results and the log in OUTDIR.
#
#   python benchmarks/gpu_steps.py plan -d gpu_run/plans [--cluster 1xh100]   # first, on any machine: the step cases' plans
#   bash benchmarks/gpu_session.sh OUTDIR [SECTION ...]         # on the GPU machine
#
# Sections (default: all but compile, in this order): profile (autoplan profile -> OUTDIR/profile.json,
# GEMMs, copy bandwidth, launch floor), layers (benchmarks/gpu_layer_time.py measure), steps
# (benchmarks/gpu_steps.py run, one-rank NCCL group), host (the host's dispatch per kernel on blocks of
# several sizes: benchmarks/gpu_layer_time.py host), diagnose (the steps again, one process per case, with each
# step's kernels by family and one microbatch's saved bytes), isolated (one process per case, without diagnose's
# torch.profiler pass), kernels (benchmarks/kernels.py against eager, its
# Triton rows written into the profile: a kernel that fails to run leaves the profile as it was), tests
# (the `gpu`-marked tests), compile (benchmarks/kernels.py with torch.compile too). The package is used from a copy of this
# checkout's folders laid out as the installed package (no build step, no network needed); `python3 -P`
# keeps this checkout's own autoplan/ (without profiler/, ...) off sys.path. LAYER_ARGS and STEPS_ARGS:
# extra arguments of the layers and steps sections (e.g. LAYER_ARGS="--only gpt-h8192").
set -u
OUTDIR=${1:?usage: gpu_session.sh OUTDIR [SECTION ...]}
shift
SECTIONS=${*:-profile layers steps kernels tests}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/session.log
PKG=$(mktemp -d)
cp -r autoplan "$PKG/autoplan"
for part in profiler cost_model solver runtime; do rm -rf "$PKG/autoplan/$part"; cp -r "$part" "$PKG/autoplan/$part"; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}

section() {  # section LIMIT_S COMMAND...: run, log, and say how it ended
    local limit=$1
    shift
    echo "== $(date -u +%T) $* (limit ${limit} s)" | tee -a "$LOG"
    timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $(date -u +%T) exit $rc" | tee -a "$LOG"
}

{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
for s in $SECTIONS; do
    case $s in
        profile) section 100 python3 -P -m autoplan.profiler.cli --no-kernels -o "$OUTDIR/profile.json" ;;
        layers) section 130 python3 benchmarks/gpu_layer_time.py measure -o "$OUTDIR/layer_times.json" ${LAYER_ARGS:-} ;;
        steps) section 110 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/gpu_steps.py run \
                   -d gpu_run/plans -o "$OUTDIR/steps.json" ${STEPS_ARGS:-} ;;
        tests) section 70 python3 -P -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_compile.py \
                   tests/test_kernels_parallel.py tests/test_kernel_costs.py ;;
        diagnose) for plan in gpu_run/plans/*.preset.json; do  # one process per case: no case's memory in another's
                case=$(basename "$plan" .preset.json)
                section 75 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/gpu_steps.py run -d gpu_run/plans \
                    -o "$OUTDIR/steps_diagnosed.json" --append --diagnose --only "$case" ${STEPS_ARGS:-}
            done ;;
        isolated) for plan in gpu_run/plans/*.preset.json; do  # diagnose's one process per case, without its profiler
                case=$(basename "$plan" .preset.json)
                section 60 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/gpu_steps.py run -d gpu_run/plans \
                    -o "$OUTDIR/steps_isolated.json" --append --only "$case" ${STEPS_ARGS:-}
            done ;;
        host) section 60 python3 benchmarks/gpu_layer_time.py host -o "$OUTDIR/host_dispatch.json" ;;
        kernels) section 60 python3 benchmarks/kernels.py --markdown --json "$OUTDIR/kernels.json" --no-compile \
                   --budget-s 0.1 --profile "$OUTDIR/profile.json" ;;
        compile) section 200 python3 benchmarks/kernels.py --markdown --json "$OUTDIR/kernels_compile.json" ;;
        *) echo "unknown section $s" | tee -a "$LOG" ;;
    esac
done
rm -rf "$PKG"
