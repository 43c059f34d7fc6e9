#!/usr/bin/env bash
# The first-GPU acceptance run: what the CPU-only CI cannot show, in one script under 8 minutes on
# one H200, ending with one table (step, result, seconds, figure).
#
#   1. gpu-tests      the GPU-marked tests (pytest -m gpu)
#   2. golden-record  goldens for this GPU platform, every quick-screen job, into a temp folder
#   3. quick-screen   `screener kat run` (the quick screen) against those goldens: must pass
#   4. preflight      `screener preflight` against them: probes + the preflight jobs, must pass
#   5. fp-bandwidth   screener.fingerprint on a 1 GiB tensor vs tensor.clone() (an HBM copy):
#                     GB/s of each and their ratio
#   6. audit-nccl     the in-job audit under NCCL (benchmarks/gpu_audit_nccl.py under torchrun):
#                     a healthy run ends with no alarm, an injected fault is caught on its rank;
#                     skipped, with the reason, on a machine with one GPU
#
# Needs only the repository, `pip install torch==2.13.0` (a CUDA build) and
# `pip install -e '.[test]'`. A step that fails is recorded in the table and the next one runs;
# the exit status is 0 when no step failed, 1 when one did, 2 without a CUDA device or on bad
# arguments. Each step's output is kept in the log folder the table names.
#
#   bash benchmarks/gpu_acceptance.sh              # on the GPU machine
#   bash benchmarks/gpu_acceptance.sh --dry-run    # anywhere: print the steps, run nothing
#   bash benchmarks/gpu_acceptance.sh --out DIR    # keep the goldens and logs in DIR
#
# PYTHON (default: python3) is the interpreter the package is installed in.

set -u

usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; }

DRY_RUN=0
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) [ $# -ge 2 ] || { echo "gpu_acceptance: --out needs a folder" >&2; exit 2; }
               OUT="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_acceptance: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
SCREENER=("$PY" -m screener.cli)
[ -n "$OUT" ] || [ "$DRY_RUN" = 0 ] || OUT="<a new temp folder>"
# The preflight must run its jobs, not take a fast path from a verdict left in the environment.
unset SCREENER_NODE_VERDICT

# --- the table -----------------------------------------------------------------------------------

NAMES=(); RESULTS=(); SECONDS_TAKEN=(); FIGURES=()
FAILED=0

record() {  # record NAME RESULT SECONDS FIGURE
    NAMES+=("$1"); RESULTS+=("$2"); SECONDS_TAKEN+=("$3"); FIGURES+=("$4")
    if [ "$2" = FAIL ]; then FAILED=1; fi
    printf 'gpu_acceptance: %-14s %-4s %6ss  %s\n' "$1" "$2" "$3" "$4" >&2
}

table() {
    printf '\n%-14s  %-6s  %8s  %s\n' "step" "result" "seconds" "figure"
    printf '%-14s  %-6s  %8s  %s\n' "--------------" "------" "--------" "------"
    local i
    for i in "${!NAMES[@]}"; do
        printf '%-14s  %-6s  %8s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" \
            "${FIGURES[$i]}"
    done
    printf '\nlogs and goldens: %s\n' "$OUT"
}

# run_step NAME LIMIT_S CMD...: runs CMD under `timeout`, its stdout and stderr into
# $LOGS/NAME.out and .err; sets STEP_RC and STEP_S. In a dry run, prints the command instead.
run_step() {
    local name="$1" limit="$2"; shift 2
    if [ "$DRY_RUN" = 1 ]; then
        printf '%-14s (limit %ss)  %s\n' "$name" "$limit" "$*"
        STEP_RC=0; STEP_S=0
        return
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
    STEP_RC=$?
    STEP_S=$((SECONDS - t0))
}

why() {  # why NAME RC: a short figure for a failed step
    if [ "$2" = 124 ] || [ "$2" = 137 ]; then echo "timed out"; return; fi
    local last
    last="$(grep -v '^\s*$' "$LOGS/$1.err" 2>/dev/null | tail -n 1 | cut -c1-70)"
    echo "exit $2${last:+: $last}"
}

json_field() {  # json_field FILE EXPR: a Python expression over the JSON document `d`
    "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' \
        "$1" "$2" 2>/dev/null || echo "?"
}

# --- preconditions -------------------------------------------------------------------------------

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_acceptance --dry-run: the steps, in order (nothing runs); PYTHON=$PY"
    GPUS=2
else
    # One interpreter start (torch's import takes seconds): GPU count, torch version, GPU name.
    probe="$("$PY" -c 'import screener, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, torch.__version__, torch.cuda.get_device_name(0) if n else "")' 2>/dev/null)"
    if [ -z "$probe" ]; then
        echo "gpu_acceptance: $PY cannot import screener and torch: pip install -e '.[test]'" >&2
        exit 2
    fi
    read -r GPUS TORCH_VERSION GPU_NAME <<<"$probe"
    if [ "$GPUS" -lt 1 ]; then
        echo "gpu_acceptance: no CUDA device (torch.cuda.is_available() is False with torch" \
             "$TORCH_VERSION): nothing to accept on this machine; --dry-run prints the steps" >&2
        exit 2
    fi
    [ -n "$OUT" ] || OUT="$(mktemp -d "${TMPDIR:-/tmp}/screener-gpu-acceptance.XXXXXX")"
    mkdir -p "$OUT/golden" "$OUT/logs" "$OUT/alarms"
    echo "gpu_acceptance: $GPUS GPU(s), $GPU_NAME, torch $TORCH_VERSION; output in $OUT" >&2
fi

GOLDEN="$OUT/golden"
LOGS="$OUT/logs"

# --- 1. the GPU-marked tests ---------------------------------------------------------------------

# Only the files that hold GPU-marked tests: collecting all of tests/ costs a minute for nothing.
mapfile -t GPU_TEST_FILES < <(grep -l 'mark\.gpu' tests/test_*.py)
run_step gpu-tests 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TEST_FILES[@]}"
if [ "$DRY_RUN" = 0 ]; then
    # pytest's last line: "12 passed, 3 deselected in 40.2s"; 5 (nothing collected) is a failure.
    summary="$(grep -v '^\s*$' "$LOGS/gpu-tests.out" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//' \
        | cut -c1-70)"
    if [ "$STEP_RC" = 0 ]; then
        record gpu-tests PASS "$STEP_S" "$summary"
    elif [ "$STEP_RC" = 124 ] || [ "$STEP_RC" = 137 ]; then
        record gpu-tests FAIL "$STEP_S" "timed out"
    else
        record gpu-tests FAIL "$STEP_S" "exit $STEP_RC: $summary"
    fi
fi

# --- 2. goldens for this platform ----------------------------------------------------------------

run_step golden-record 80 "${SCREENER[@]}" golden record -d all -r 2 --out "$GOLDEN" --json
if [ "$DRY_RUN" = 0 ]; then
    files="$(find "$GOLDEN" -name '*.json' | wc -l)"
    platform="$(json_field "$LOGS/golden-record.out" \
        'sorted({v["platform_hash"] for v in d["screen"]["verdicts"]})')"
    if [ "$STEP_RC" = 0 ] && [ "$files" -gt 0 ]; then
        record golden-record PASS "$STEP_S" "$files golden files, platform $platform"
    else
        record golden-record FAIL "$STEP_S" "$(why golden-record "$STEP_RC"); $files files"
    fi
fi

# --- 3. the quick screen against them ------------------------------------------------------------

run_step quick-screen 45 "${SCREENER[@]}" kat run -d all --golden-dir "$GOLDEN" --json
if [ "$DRY_RUN" = 0 ]; then
    outcome="$(json_field "$LOGS/quick-screen.out" 'd["outcome"]')"
    if [ "$STEP_RC" = 0 ] && [ "$outcome" = pass ]; then
        record quick-screen PASS "$STEP_S" "outcome pass on $GPUS GPU(s)"
    else
        record quick-screen FAIL "$STEP_S" "outcome $outcome; $(why quick-screen "$STEP_RC")"
    fi
fi

# --- 4. the preflight ----------------------------------------------------------------------------

run_step preflight 45 "${SCREENER[@]}" preflight -d all --golden-dir "$GOLDEN" \
    --alarm-dir "$OUT/alarms" --json
if [ "$DRY_RUN" = 0 ]; then
    outcome="$(json_field "$LOGS/preflight.out" 'd["outcome"]')"
    worst="$(json_field "$LOGS/preflight.out" 'd["probes"]["worst"]')"
    if [ "$STEP_RC" = 0 ] && [ "$outcome" = pass ]; then
        record preflight PASS "$STEP_S" "outcome pass, worst probe finding $worst"
    else
        record preflight FAIL "$STEP_S" "outcome $outcome, probes $worst; $(why preflight "$STEP_RC")"
    fi
fi

# --- 5. fingerprint bandwidth against an HBM copy ------------------------------------------------

FP_BANDWIDTH='
import json, torch
from screener.fingerprint import backend, fingerprint
x = torch.randn(1 << 28, device="cuda:0")  # 1 GiB of float32
n = x.numel() * x.element_size()

def timed(fn, rounds=10):
    fn(); torch.cuda.synchronize()  # warm up: kernels compiled, memory allocated
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / rounds

fp_s = timed(lambda: fingerprint(x))
copy_s = timed(lambda: x.clone())
fp = n / fp_s / 1e9                 # the fingerprint reads each byte once
copy = 2 * n / copy_s / 1e9         # a copy reads and writes each byte
print(json.dumps({"fingerprint_gbps": round(fp, 1), "copy_gbps": round(copy, 1),
                  "ratio": round(fp / copy, 3), "backend": backend("cuda:0"),
                  "figure": f"fingerprint ({backend(x.device)}) {fp:.0f} GB/s, "
                            f"copy {copy:.0f} GB/s, ratio {fp / copy:.2f}"}))
'
[ "$DRY_RUN" = 1 ] || printf '%s' "$FP_BANDWIDTH" >"$OUT/fp_bandwidth.py"
run_step fp-bandwidth 45 "$PY" "$OUT/fp_bandwidth.py"
if [ "$DRY_RUN" = 0 ]; then
    if [ "$STEP_RC" = 0 ]; then
        record fp-bandwidth PASS "$STEP_S" "$(json_field "$LOGS/fp-bandwidth.out" 'd["figure"]')"
    else
        record fp-bandwidth FAIL "$STEP_S" "$(why fp-bandwidth "$STEP_RC")"
    fi
fi

# --- 6. the audit under NCCL ---------------------------------------------------------------------

NPROC=$(( GPUS < 4 ? GPUS : 4 ))  # enough for a ring of neighbours; more adds time, not cover
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
if [ "$DRY_RUN" = 1 ]; then
    echo "(audit-nccl runs only with 2 or more GPUs; on one it is skipped with the reason)"
fi
if [ "$GPUS" -lt 2 ]; then
    record audit-nccl SKIP 0 "one GPU: NCCL across ranks needs 2 or more"
else
    run_step audit-nccl 45 "${TORCHRUN[@]}" benchmarks/gpu_audit_nccl.py
    healthy_rc=$STEP_RC; healthy_s=$STEP_S
    run_step audit-nccl-fault 45 "${TORCHRUN[@]}" benchmarks/gpu_audit_nccl.py --inject-rank 1
    if [ "$DRY_RUN" = 0 ]; then
        # torchrun exits 1 when a worker fails; the workers' 75 and the alarm are in the log.
        caught="$(grep -h '"alarm"' "$LOGS/audit-nccl-fault.out" | tail -n 1)"
        if [ "$healthy_rc" = 0 ] && printf '%s' "$caught" | grep -q '"suspect_ranks": \[1\]'; then
            record audit-nccl PASS "$((healthy_s + STEP_S))" \
                "$NPROC ranks: healthy no alarm; fault on rank 1 caught ($(json_field /dev/stdin 'd["alarm"]' <<<"$caught"))"
        else
            record audit-nccl FAIL "$((healthy_s + STEP_S))" \
                "healthy exit $healthy_rc; fault run: ${caught:-no alarm line} (exit $STEP_RC)"
        fi
    fi
fi

if [ "$DRY_RUN" = 1 ]; then
    echo "then one table: step, result (PASS/FAIL/SKIP), seconds, figure"
    exit 0
fi
table
exit "$FAILED"
