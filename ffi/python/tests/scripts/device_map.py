"""A model too large for one card spread over two by transformers'
device_map="auto" (a Llama from a tiny configuration saved to a scratch
directory; its layers split by each card's max_memory), then a forward."""
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)
with tempfile.TemporaryDirectory() as saved:
    LlamaForCausalLM(config).save_pretrained(saved)
    model = LlamaForCausalLM.from_pretrained(saved, device_map="auto", max_memory={0: "8MiB", 1: "40MiB"})
print(sorted(set(model.hf_device_map.values())))
with torch.inference_mode():
    model(torch.randint(0, 1024, (4, 64)).cuda())
