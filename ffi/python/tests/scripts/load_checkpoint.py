"""Weights from a checkpoint torch.save wrote: torch.load (map_location
from the command line: none, cpu, cuda, cuda:0), then into a model made
on the card with load_state_dict; what the card holds after each step."""
import sys

import torch


class Net(torch.nn.Module):
    """An embedding and an output layer that share their weight, and a
    projection between them."""

    def __init__(self, vocab, width):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.proj = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight


def main():
    path, where = sys.argv[1], sys.argv[2]
    state = torch.load(path, map_location=None if where == "none" else where)
    for name in state:
        print(name, state[name].device, tuple(state[name].shape), state[name].dtype)
    shared = state["head.weight"].untyped_storage()._cdata == state["embed.weight"].untyped_storage()._cdata
    print(f"tied {shared}")
    print(f"loaded {torch.cuda.memory_allocated()}")
    vocab, width = state["embed.weight"].shape
    with torch.device("cuda"):
        model = Net(vocab, width)
    print(f"model {torch.cuda.memory_allocated()}")
    model.load_state_dict(state)
    del state
    print(f"state dropped {torch.cuda.memory_allocated()}")
    print(f"peak {torch.cuda.max_memory_allocated()}")


if __name__ == "__main__":
    main()
