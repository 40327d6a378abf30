"""Inference with a model loaded from a local directory (its config.json
and weights, as save_pretrained writes them): no hub, so it loads. A
second argument is from_pretrained's device_map (the weights loaded onto
the card), else the model is moved there with `.to("cuda")`."""
import sys

import torch
from transformers import AutoModelForCausalLM

if len(sys.argv) > 2:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map=sys.argv[2]).eval()
else:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda").eval()
print(model.model.embed_tokens.weight.device, model.lm_head.weight is model.model.embed_tokens.weight)
with torch.inference_mode():
    logits = model(torch.zeros(2, 32, dtype=torch.long, device="cuda")).logits
print(tuple(logits.shape), logits.device)
print(f"peak {torch.cuda.max_memory_allocated()} bytes")
