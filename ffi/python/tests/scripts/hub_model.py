"""Fine-tuning a model from the Hugging Face hub, as tutorials begin."""
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("tidepool-tests/no-such-model-here").cuda()
print(sum(p.numel() for p in model.parameters()))
