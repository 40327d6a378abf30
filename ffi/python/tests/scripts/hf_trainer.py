"""Fine-tuning with Hugging Face's Trainer, as its examples do: a causal LM
(a Llama from a tiny configuration: nothing downloaded), a dataset of
token ids, TrainingArguments from the command line's few options
(gradient checkpointing among them)."""
import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count, seq, vocab):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_config():
    return LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    model = LlamaForCausalLM(tiny_config())
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.max_steps,
                                     learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                                     dataloader_num_workers=0, disable_tqdm=True,
                                     gradient_checkpointing=args.gradient_checkpointing)
        Trainer(model=model, args=training, train_dataset=Tokens(64, args.seq, 1024)).train()
    print(f"peak {torch.cuda.max_memory_allocated()} bytes")


if __name__ == "__main__":
    main()
