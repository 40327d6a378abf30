"""Greedy decoding with a transformers model built from a tiny
configuration (nothing downloaded): the prompt, then one token at a time
with the model's KV cache, as a generation loop writes it, or the same
with transformers' generate (--generate; no EOS is known to come)."""
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
    parser.add_argument("--generate", action="store_true", help="transformers' generate instead of the loop")
    args = parser.parse_args()
    model = LlamaForCausalLM(tiny_config()).to("cuda").eval()
    ids = torch.randint(0, 1024, (args.batch, args.prompt)).cuda()
    if args.generate:
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0)
        print(f"generated {tuple(out.shape)}")
    else:
        decode(model, ids, args.new_tokens)
    print(f"peak {torch.cuda.max_memory_allocated()} bytes")


def decode(model, ids, new_tokens):
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for _ in range(new_tokens - 1):
            token = out.logits[:, -1:].argmax(-1)
            del out
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
        del out, cache


if __name__ == "__main__":
    main()
