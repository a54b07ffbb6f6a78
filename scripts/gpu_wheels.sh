#!/usr/bin/env bash
# .whl/ for scripts/gpu_session.sh: what the device's image (Python 3.12, torch 2.11 with CUDA,
# no network) lacks for partrain, DeepSpeed, torchao's FP8 and torchtitan, as wheels, and
# libaio's header and library for DeepSpeed's async_io op (the nvme stages). Run here, from the
# repository root, in the venv of the README (its torch builds DeepSpeed's wheel); about 11 MB:
#
#   bash scripts/gpu_wheels.sh        # then the device tool: carry [".whl"]
#
# The image's own packages (KINDS.md of the device tool: numpy, typer, rich, safetensors,
# tokenizers, pyarrow, huggingface-hub, einops, tensorboard, ...) are not carried. One version of
# each name: two stop gpu_session.sh's install.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl/libaio/include .whl/libaio/lib
platform=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pydantic-core must be the one pydantic names; torchao 0.17 is torch 2.11's; torchtitan 0.2.2
# is the newest that runs on torch 2.11 (0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims);
# datasets 5.2 wants dill < 0.4.2 and multiprocess < 0.70.20
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform[@]}" -d .whl \
    omegaconf==2.3.0 hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
    typing-inspection typing-extensions torchao==0.17.0 torchtitan==0.2.2 torchdata datasets==5.2.0 \
    dill==0.4.1 multiprocess==0.70.19 tyro docstring-parser typeguard tomli
# PyPI has these as source only: pure-Python wheels built here (DeepSpeed's ops are built on the
# device when first used, its JIT)
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    deepspeed==0.19.8 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8
# Debian's libaio (old glibc symbols only), copied as plain files: a link travels as a link
if [[ ! -e /usr/include/libaio.h ]]; then
    apt-get install -y -q libaio-dev >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libaio-dev >/dev/null; }
fi
cp /usr/include/libaio.h .whl/libaio/include/
lib=$(readlink -f /usr/lib/x86_64-linux-gnu/libaio.so.1)
cp "$lib" .whl/libaio/lib/libaio.so.1
cp "$lib" .whl/libaio/lib/libaio.so
ls .whl
du -sh .whl
