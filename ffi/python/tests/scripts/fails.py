"""A script with a bug: shapes that do not fit, found on the card."""
import torch

model = torch.nn.Linear(64, 32).cuda()
x = torch.randn(8, 48, device="cuda")


def step():
    return model(x).sum()


step()
