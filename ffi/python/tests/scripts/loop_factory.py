"""train_loop.py's model as a `module:` factory, for the model path's
options (--zero-grad): the same network, fed (inputs, labels)."""
import torch
import torch.nn.functional as F

from tidepool.workload import Workload
from train_loop import Net


class WithLabels(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return self.net(x)


def workload(width=256, depth=16, classes=10):
    def make_batch(batch, seq):
        return torch.randn(batch, width, device="meta"), torch.randint(0, classes, (batch,), device="meta")

    return Workload(WithLabels(Net(width, depth, classes)), make_batch,
                    loss=lambda output, inputs: F.cross_entropy(output, inputs[1]))
