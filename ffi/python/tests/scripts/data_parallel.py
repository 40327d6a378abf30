"""torch.nn.DataParallel over every card of the machine, as its tutorial
writes it: one process, the batch split between the cards, the replicas'
outputs gathered on the first."""
import torch

model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
model = torch.nn.DataParallel(model).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(2):
    x = torch.randn(512, 1024, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"{torch.cuda.device_count()} cards: " + ", ".join(
    f"cuda:{i} {torch.cuda.max_memory_allocated(i)}" for i in range(torch.cuda.device_count())))
