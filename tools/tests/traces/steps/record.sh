#!/usr/bin/env bash
# Records the repeated steps that tools/tests/tools/expandable.rs replays:
# each a small model's training (or generation) step run four times (three
# for generation) on the meta device by `python -m tidepool.plan`, which
# marks each step in the trace. Run from the root of a checkout with torch
# and transformers installed (`./test.sh` builds such a venv):
#
#     PYTHON=.venv/bin/python tools/tests/traces/steps/record.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=tools/tests/traces/steps
python=${PYTHON:-python3}
export PYTHONPATH=ffi/python${PYTHONPATH:+:$PYTHONPATH}

record() {
    local name=$1
    shift
    local dir
    dir=$(mktemp -d)
    "$python" -m tidepool.plan "$@" --keep-traces "$dir" --cards H200 >/dev/null
    mv "$dir/variant-1.csv" "$out/$name.csv"
    rm -r "$dir"
    echo "$out/$name.csv: $*"
}

gpt2="hf:gpt2 --set n_layer=2 --batch 2 --seq 128"
record gpt2-fp32 $gpt2 --steps 4
record gpt2-bf16-mixed $gpt2 --precision bf16-mixed --steps 4
record llama-bf16-mixed-checkpointing hf:llama --set num_hidden_layers=2 --set hidden_size=512 \
    --set intermediate_size=1408 --set num_attention_heads=8 --set num_key_value_heads=8 \
    --batch 2 --seq 256 --precision bf16-mixed --checkpointing --steps 4
record bert-fp16-mixed hf:bert --set num_hidden_layers=2 --batch 8 --seq 128 --precision fp16-mixed --steps 4
record vit-bf16-mixed hf:vit --set num_hidden_layers=2 --batch 8 --precision bf16-mixed --steps 4
record resnet-fp32 hf:resnet --batch 8 --steps 4
record own-optimizer module:ffi.python.examples.own_optimizer:model_and_optimizer --steps 4
record gpt2-generate hf:gpt2 --set n_layer=2 --task generate --batch 4 --seq 64 --new-tokens 16 --steps 3
