"""A memory-profiling script as the course repositories of
../shared/traces/pytorch-snapshots write theirs: a GPT-style model (the
course code's architecture, plan_models.BasicsLM), warm-up steps, then
PyTorch's memory history recorded over one step, its peak printed and its
snapshot dumped.

python profile_memory.py --d_model 1024 --d_ff 4096 --num_layers 24 --num_heads 16
    --context_length 128 --pattern forward-only --snapshot out.pickle"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from plan_models import BasicsLM  # noqa: E402


def cross_entropy(logits, targets):
    shifted = logits - logits.max(dim=-1, keepdim=True)[0]
    log_probs = shifted - shifted.exp().sum(dim=-1, keepdim=True).log()
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def main():
    parser = argparse.ArgumentParser()
    for name, default in (("vocab_size", 10000), ("context_length", 512), ("d_model", 768), ("d_ff", 3072),
                          ("num_layers", 12), ("num_heads", 12), ("batch_size", 4), ("warmup_steps", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--pattern", choices=["forward-only", "full-training-step"], default="forward-only")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast")
    parser.add_argument("--snapshot", default="memory_snapshot.pickle")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = BasicsLM(args.d_model, args.d_ff, args.num_layers, args.num_heads, vocab=args.vocab_size,
                     context_length=args.context_length).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    shape = (args.batch_size, args.context_length)
    ids = lambda: torch.randint(0, args.vocab_size, shape, device=device)  # noqa: E731
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.autocast)

    def step():
        with amp:
            if args.pattern == "forward-only":
                return model(ids())
            loss = cross_entropy(model(ids()), ids())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if args.pattern == "forward-only":
        model.eval()
        context = torch.inference_mode()
    else:
        context = torch.enable_grad()
    with context:
        for _ in range(args.warmup_steps):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        step()
        torch.cuda.synchronize()
    print(f"peak allocated: {torch.cuda.max_memory_allocated()} bytes")
    torch.cuda.memory._dump_snapshot(args.snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
