"""Greedy decoding with a transformers model built from a tiny
configuration (nothing downloaded): the prompt, then one token at a time
with the model's KV cache, as a generation loop writes it."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_config():
    return LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    model = LlamaForCausalLM(tiny_config()).to("cuda").eval()
    ids = torch.randint(0, 1024, (args.batch, args.prompt)).cuda()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for _ in range(args.new_tokens - 1):
            token = out.logits[:, -1:].argmax(-1)
            del out
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
        del out, cache
    print(f"peak {torch.cuda.max_memory_allocated()} bytes")


if __name__ == "__main__":
    main()
