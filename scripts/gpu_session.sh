#!/usr/bin/env bash
# Issue 33's measurements on a lent GPU machine, in stages that each fit one device call
# (10 minutes at most): run from the repository root there, with .whl/ carried (partrain's and
# torchtitan's wheels beyond the machine's image; see scripts/gpu_side_by_side.py), e.g.
#
#   bash scripts/gpu_session.sh full:140 nvme:300  # the device tool's command, carry [".whl"]
#
# A session has 15 minutes of device time and a call 10: give each stage a limit (below) and
# put several in a call. .whl/ is made here by `bash scripts/gpu_wheels.sh`. Measured on an
# H200 (wall, stage included): cp 13 s, side 121 s, full 96 s, mb8 66 s, fp8 327 s (about 100 s
# a case at 200 steps), fp8w 139 s for two of its three cases, fork 37 s, pp 88 s alone; nvme's
# host case 111 s (its op's first build included) and the disk's case of the 1B shape more than
# 185 s for 4 steps (23.8 s its first): nvme-s for the disk's figure. On a warm machine
# /tmp/gpuwork's token dir is reused.
# Stages:
#   cp     scripts/check_cp_fused.py: the ring's fused CUDA block against the written-out one
#   check  scripts/gpu_check.py: ddp, ddp + compile, fsdp2, zero3, zero3 + nvme
#   nvme   the same, ZeRO-3's optimizer on the host against on the disk, 6 steps (point 7;
#          libaio from .whl/libaio where the image has none)
#   nvme-s the same on a smaller model (4 of the 1B shape's layers, a 32,000 vocabulary: 0.37B
#          parameters), where the disk's 6 steps fit a stage (the 1B shape's 4 did not in 185 s)
#   side   scripts/gpu_side_by_side.py: partrain against torchtitan, no checkpointing
#   full   the same with full activation checkpointing
#   prof   both trainers profiled (torch.profiler, 3 steps after the warm-up): where the time goes
#   fp8    FP8 (tensorwise, rowwise) against bf16, compiled, 200 steps: tokens/s and loss gap
#   fp8r   FP8 rowwise alone against bf16, 200 steps (fp8's third case, cut from it by a limit once)
#   fp8w   the same on Llama-3-8B's block in 4 layers, 30 steps (where matmuls dominate)
#   fp8wr  FP8 rowwise alone on that block against bf16 (fp8w's third case, cut by its limit once)
#   fp16moe the MoE balancing loss under fp16's loss scale: tiny-moe-like experts on 4 of the 1B
#          shape's layers, ZeRO-1 bf16, fp16 and balance=none, 40 steps: fp16's load balance
#          (max/mean tokens per expert) must follow bf16's, not none's
#   fp16res scripts/check_resume.py: the tiny model in fp16 under ZeRO-1 on the GPU, 40 steps
#          against 20 + a resume to 40: the same losses and skipped steps (the loss scale is kept)
#   mb8    partrain alone at micro-batch 8 (one micro-batch a step): point 2's micro-batch size
#   fork   scripts/bench_start.py on CUDA: the tiny run forked from the rank server
#          (launcher.start_method=forkserver) against spawned, 20 steps each: it must train alike
#   pp     scripts/bench_pp.py on the machine's 16 CPU cores (no GPU needed: last, if time is left)
#   pp-bg  the same in the background on cores 0 and 1 (one pinned rank each), every later stage
#          pinned to the other cores; the call waits for it at the end
# A stage may carry a limit in seconds, `side:300`: it is stopped there (timeout) and what it
# wrote so far still comes back, so several stages fit one call without one eating the rest.
# Each stage's output goes to $OUT/<stage>.log (and what it prints as JSON to $OUT/<stage>.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl) || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
# libaio for DeepSpeed's async_io op (the nvme stage), should the device's image lack it: Debian's
# libaio.h and libaio.so.1 (old glibc symbols only) in .whl/libaio, copied from this machine's
# `apt-get install libaio-dev`; gcc reads CPATH and LIBRARY_PATH, the loader LD_LIBRARY_PATH
if [[ -d .whl/libaio ]]; then
    aio=$PWD/.whl/libaio
    export CPATH=$aio/include${CPATH:+:$CPATH} LIBRARY_PATH=$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
python3 -c "import torch, partrain, deepspeed, torchtitan; print(torch.__version__, torch.cuda.get_device_name(0))"
pin=()
for spec in "$@"; do
    stage=${spec%%:*}
    limit=600
    [[ "$spec" == *:* ]] && limit=${spec#*:}
    start=$(date +%s)
    run() { ${pin[@]+"${pin[@]}"} timeout -k 5 "$limit" "$@"; }
    case "$stage" in
        cp) run python3 scripts/check_cp_fused.py --json > "$OUT/cp.json" 2> "$OUT/cp.log" ;;
        check) run python3 scripts/gpu_check.py --work /tmp/gpuwork --only ddp "ddp + compile" fsdp2 zero3 "zero3 + nvme" \
            --json > "$OUT/check.json" 2> "$OUT/check.log" ;;
        nvme) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 6 --warmup 2 \
            --only "zero3 + offload" "zero3 + nvme" --json > "$OUT/nvme.json" 2> "$OUT/nvme.log" ;;
        nvme-s) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 6 --warmup 2 \
            --only "zero3 + offload" "zero3 + nvme" --extra model.n_layers=4 model.vocab_size=32000 \
            --json > "$OUT/nvme-s.json" 2> "$OUT/nvme-s.log" ;;
        side) run python3 scripts/gpu_side_by_side.py --site /tmp/site --work /tmp/gpuwork --json \
            > "$OUT/side.json" 2> "$OUT/side.log" ;;
        full) run python3 scripts/gpu_side_by_side.py --site /tmp/site --work /tmp/gpuwork --ckpt full --json \
            > "$OUT/full.json" 2> "$OUT/full.log" ;;
        prof) run python3 scripts/gpu_side_by_side.py --site /tmp/site --work /tmp/gpuwork --profile \
            --json > "$OUT/prof.json" 2> "$OUT/prof.log" ;;
        fp8) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 200 --warmup 20 \
            --only "ddp + compile" "float8 tensorwise" "float8 rowwise" \
            --json > "$OUT/fp8.json" 2> "$OUT/fp8.log" ;;
        fp8r) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 200 --warmup 20 \
            --only "ddp + compile" "float8 rowwise" --json > "$OUT/fp8r.json" 2> "$OUT/fp8r.log" ;;
        fp8w) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 30 --warmup 10 \
            --only "ddp + compile" "float8 tensorwise" "float8 rowwise" \
            --extra model.dim=4096 model.n_heads=32 model.n_kv_heads=8 model.ffn_dim=14336 \
            model.n_layers=4 --json > "$OUT/fp8w.json" 2> "$OUT/fp8w.log" ;;
        fp8wr) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 30 --warmup 10 \
            --only "ddp + compile" "float8 rowwise" \
            --extra model.dim=4096 model.n_heads=32 model.n_kv_heads=8 model.ffn_dim=14336 \
            model.n_layers=4 --json > "$OUT/fp8wr.json" 2> "$OUT/fp8wr.log" ;;
        fp16moe) run python3 scripts/gpu_check.py --work /tmp/gpuwork --steps 40 --warmup 5 \
            --only "moe zero1" "moe zero1 fp16" "moe zero1 unbalanced" --extra model.n_layers=4 \
            --json > "$OUT/fp16moe.json" 2> "$OUT/fp16moe.log" ;;
        fp16res) run python3 scripts/check_resume.py --nproc 1 --steps 40 --work /tmp/gpuwork/resume \
            --extra launcher.device=cuda train.dtype=fp16 parallel.zero_stage=1 parallel.dp=1 \
            --json > "$OUT/fp16res.json" 2> "$OUT/fp16res.log" ;;
        mb8) run python3 scripts/gpu_side_by_side.py --site /tmp/site --work /tmp/gpuwork --only partrain \
            --micro-batch 8 --json > "$OUT/mb8.json" 2> "$OUT/mb8.log" ;;
        fork) run python3 scripts/bench_start.py --device cuda --layouts dp1 --reps 1 --steps 20 \
            --json > "$OUT/fork.json" 2> "$OUT/fork.log" ;;
        pp) run python3 scripts/bench_pp.py --json > "$OUT/pp.json" 2> "$OUT/pp.log" ;;
        pp-bg) taskset -c 0,1 timeout -k 5 "$limit" python3 scripts/bench_pp.py --json \
                > "$OUT/pp.json" 2> "$OUT/pp.log" &
            pin=(taskset -c "2-$(( $(nproc) - 1 ))")
            echo "pp-bg: started"; continue ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac
    echo "$stage: exit $? (limit $limit s) in $(( $(date +%s) - start )) s"
    tail -c 1500 "$OUT/$stage.json"
done
wait
[[ -s "$OUT/pp.json" ]] && { echo "pp:"; tail -c 1500 "$OUT/pp.json"; }
