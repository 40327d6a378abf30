"""One matmul: what it adds to torch.cuda.memory_allocated() beyond its
output is the cuBLAS workspace PyTorch gives the thread on this card."""
import torch

a = torch.ones(1024, 1024, device="cuda")
before = torch.cuda.memory_allocated()
b = a @ a
print(f"{torch.cuda.get_device_name()}: workspace {torch.cuda.memory_allocated() - before - b.nbytes} bytes")
