#!/usr/bin/env bash
# Everything the GPU machine runs, in one go: the benchmarks behind each row of issue 17's table
# (each against a reference measured in the same run), then tests/gpu, then the table itself
# (bench/gpu_summary.py -> $OUT/summary.md). About 9-10 minutes on an H100 with the default limits;
# where one call allows less, split it: `TESTS=0 SAMPLE=0` then `PUBLISH=0 TRAIN=0`, and run
# `python bench/gpu_summary.py DIR` over the two result folders copied into one.
# TESTS=0 / TRAIN=0 / SAMPLE=0 / PUBLISH=0 skip a part; NO_CKPT=1 adds a training run without
# checkpointing; CPU=1 adds the CPU row (bench/train_step.py --mixed; needs the embedded model).
# Runs from the repository root with the machine's python; results land in $OUT (or bench/results).
set -u
OUT=${OUT:-bench/results}; mkdir -p "$OUT"; export OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the package as it installs (clawbridge/, clawbridge/backends, ...), without pip
rm -rf build/pkg && mkdir -p build/pkg/clawbridge
for f in bridge/*; do ln -s "$PWD/$f" build/pkg/clawbridge/; done
for d in backends judges local_gpu; do ln -s "$PWD/$d" build/pkg/clawbridge/$d; done
export PYTHONPATH="$PWD/build/pkg"
python -c "import peft, pytest, pytest_asyncio" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu_assets/site"
# the server's own dependencies (starlette, uvicorn, SQLAlchemy, pydantic, openai...) for tests/gpu's
# end-to-end `up` test, as cp312 wheels in build/gpu_assets/wheels where the machine lacks them
if ! python -c "import starlette, sqlalchemy, pydantic_settings, openai" 2>/dev/null && [ -d build/gpu_assets/wheels ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cb-site build/gpu_assets/wheels/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/cb-site"
fi
export CLAWBRIDGE_TOKENIZER_DIR="$PWD/build/gpu_assets/tokenizer"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$OUT/env.txt"
[ "${PUBLISH:-1}" = 1 ] && timeout ${T_PUB:-90} python bench/publish_latency.py --engine-model arch:qwen3-4b --tokenizer build/gpu_assets/tokenizer --repeat 5 2>&1 | tail -25 | tee "$OUT/publish.txt"
[ "${SAMPLE:-1}" = 1 ] && timeout ${T_SAMPLE:-240} python bench/gpu_sample.py --arch qwen3-4b --tokenizer build/gpu_assets/tokenizer ${SAMPLE_ARGS:---concurrency 1 32} 2>&1 | tail -120 | tee "$OUT/gpu_sample.txt"
[ "${TRAIN:-1}" = 1 ] && timeout ${T_TRAIN:-170} python bench/gpu_train.py --arch qwen3-4b --batch 8 --prompt 512 --completion 512 --steps 4 2>&1 | tail -40 | tee "$OUT/gpu_train.txt"
[ -n "${NO_CKPT:-}" ] && timeout ${T_TRAIN:-170} python bench/gpu_train.py --arch qwen3-4b --batch 8 --prompt 512 --completion 512 --steps 4 --no-checkpointing --no-reference 2>&1 | tail -40 | tee "$OUT/gpu_train_nockpt.txt"
[ "${CPU:-0}" = 1 ] && timeout ${T_CPU:-300} python bench/train_step.py --mixed --samples 8 --tokens 2048 --repeats 2 --json > "$OUT/train_step.json" 2> "$OUT/train_step.err"
# the whole log is kept (a failure's cause is often far above pytest's last lines)
[ "${TESTS:-1}" = 1 ] && { timeout ${T_TESTS:-120} python -m pytest -q -p no:cacheprovider tests/gpu -x > "$OUT/tests_gpu.txt" 2>&1; tail -25 "$OUT/tests_gpu.txt"; }
cp /tmp/cb-train-*/trainer.log "$OUT/" 2>/dev/null || true
python bench/gpu_summary.py "$OUT"
