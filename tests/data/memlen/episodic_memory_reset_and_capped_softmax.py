"""Correct: a recurrent-memory policy (eager softmax over [memory | segment], time first) whose module keeps
`self.mem_len = 30`: segments of 20 steps fill the memory to 20, then 30, where it stays; a new episode empties it
(the next segment attends no memory), and the episode's last segment is shorter (8 steps). Every step's memory is
min(mem_len, the last memory + the last segment) or empty: nothing dropped."""
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, memory):
        both = torch.cat([memory, x], dim=0)  # (time, batch, width)
        n, m = x.shape[0], memory.shape[0]
        scores = torch.einsum("ibd,jbd->bij", self.q(x), self.k(both)) / 4.0
        future = torch.ones(n, m + n, dtype=torch.bool).triu(diagonal=m + 1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return x + torch.einsum("bij,jbd->ibd", weights, self.v(both))


class MemoryPolicy(nn.Module):
    def __init__(self, width=16, layers=2, mem_len=30):
        super().__init__()
        self.mem_len, self.layers = mem_len, nn.ModuleList(Attention(width) for _ in range(layers))

    def forward(self, x, memory):
        hidden = []
        for layer, mem in zip(self.layers, memory):
            hidden.append(x)
            x = layer(x, mem)
        return x, [torch.cat([m, h], dim=0)[-self.mem_len:].detach() for m, h in zip(memory, hidden)]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    policy = MemoryPolicy().eval()
    for episode in range(2):
        memory = [torch.zeros(0, 3, 16) for _ in policy.layers]  # a new episode: an empty memory
        for steps in (20, 20, 20, 8):
            out, memory = policy(torch.randn(steps, 3, 16), memory)
    print(out.norm().item(), memory[0].shape[0])


if __name__ == "__main__":
    main()
