"""The optimizer made before the model moves to the card (as accelerate's
examples do, `prepare` moving the model afterwards), with the output
layer's weight tied to the embedding's: the parameters keep their
identity through `.cuda()`, as on CUDA."""
import torch


class Tied(torch.nn.Module):
    def __init__(self, vocab=4096, width=512):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mlp(self.emb(ids)))


if __name__ == "__main__":
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.cuda()
    assert model.head.weight is model.emb.weight is optimizer.param_groups[0]["params"][0]
    for step in range(2):
        ids = torch.randint(0, 4096, (8, 128)).cuda()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
