"""Inference with a model loaded from a local directory (its config.json
and weights, as save_pretrained writes them): no hub, so it loads."""
import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda").eval()
with torch.inference_mode():
    logits = model(torch.zeros(2, 32, dtype=torch.long, device="cuda")).logits
print(tuple(logits.shape), logits.device)
print(f"peak {torch.cuda.max_memory_allocated()} bytes")
