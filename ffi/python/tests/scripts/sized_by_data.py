"""Results whose size is the data's: the positive values, the distinct ones."""
import torch

x = torch.randn(1000, 64, device="cuda")
print(tuple((x > 0).nonzero().shape), tuple(x[x > 0].shape), tuple(torch.masked_select(x, x > 0).shape))
values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
print(tuple(values.shape), tuple(inverse.shape), tuple(counts.shape), tuple(torch.unique_consecutive(x).shape))
