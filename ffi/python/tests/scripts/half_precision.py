"""A model moved to the card, then cast there (`.half()`, `.to(device,
dtype)`), its optimizer made first: each parameter stays the object the
optimizer holds, and its memory is its new type's."""
import torch

model = torch.nn.Linear(1024, 1024).cuda()
weight = model.weight
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
print(torch.cuda.memory_allocated())
model.half()
assert model.weight is weight and weight.dtype == torch.float16 and weight.is_cuda
print(torch.cuda.memory_allocated())
model.to("cuda", torch.bfloat16)
assert model.weight is weight is optimizer.param_groups[0]["params"][0] and weight.dtype == torch.bfloat16
assert isinstance(weight, torch.nn.Parameter)
print(torch.cuda.memory_allocated())
