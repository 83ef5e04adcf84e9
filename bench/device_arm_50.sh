#!/usr/bin/env bash
# #50's device arm, as prepared on 2026-12-08 and not yet run (no machine started):
# run on a lent H100/H200 from a copy of the repo in /tmp/repo, with SmolLM2 converted to
# /tmp/smollm2 (`python -m workers.fixtures.smollm2 /tmp/smollm2 --gguf FILE`, the gguf
# wheel on PYTHONPATH) and started with `setsid nohup bash bench/device_arm_50.sh &`.
# Figures land in /tmp/res: the trainer's old and new steps side by side (alone on the
# GPU), then 20,000 target-written conversations trained online and offline on the same
# ones (held-out tau_sim and tokens/s of each in their train.log / train_summary.json).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
mkdir -p /tmp/res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/res/gpu.txt
python3 bench/train_gpu.py --config smollm2 --draft-intermediate-size 6144 --seq-len 256 \
    --batch-tokens 32768 --warmup 5 --steps 15 --json /tmp/res/train_smollm2.json \
    --profile > /tmp/res/train_smollm2.txt 2>&1
COMMON=(--model /tmp/smollm2 --batch-size 4096 --epochs 3 --batch-tokens 32768
        --draft-intermediate-size 6144 --device cuda --eval-tokens 96 --no-baseline)
python3 bench/eagle3_smollm2.py "${COMMON[@]}" --work /tmp/online --prompts self:20000 \
    --online --steps prompts,generate,vocab,train > /tmp/res/online.txt 2>&1
python3 bench/eagle3_smollm2.py "${COMMON[@]}" --work /tmp/offline --prompts self:20000 \
    --conversations /tmp/online/generate/conversations.jsonl --store fp8 \
    --steps prompts,extract,vocab,train > /tmp/res/offline.txt 2>&1
for arm in online offline; do
    cp /tmp/$arm/train/train_summary.json /tmp/res/summary_$arm.json 2>/dev/null
    grep -h "tokens/s\|held-out at step\|done:" /tmp/$arm/train.log > /tmp/res/train_$arm.txt
done
# then the hand-written questions on the online draft (k = 3 and 5, 96 new tokens)
python3 bench/eagle3_smollm2.py "${COMMON[@]}" --work /tmp/online --prompts self:20000 \
    --online --steps evaluate >> /tmp/res/online.txt 2>&1
touch /tmp/res/done
