# Two correct softmaxes over the query axis of padded scores (no --fixed: nothing to fix).
# 1. Slot Attention over a padded set (google-research slot_attention, as ported to PyTorch with input masks): the
#    slots compete for each input (softmax over the slots, dim 1), the padded inputs' weights are then zeroed by the
#    0/1 input mask and each slot's weights renormalised over the inputs before the weighted mean.
# 2. LoFTR's dual-softmax coarse matching: sim (n, l, s) filled with -1e9 outside both images' masks, the confidence
#    softmax(sim, 1) * softmax(sim, 2): the product of two softmaxes, never summed over the keys with values.
import torch
from torch import nn

torch.manual_seed(0)


class SlotAttention(nn.Module):
    def __init__(self, num_slots=3, dim=16, iters=2, eps=1e-8):
        super().__init__()
        self.num_slots, self.iters, self.eps, self.scale = num_slots, iters, eps, dim ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gru = nn.GRUCell(dim, dim)
        self.norm_input, self.norm_slots = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, inputs, mask):
        b, n, d = inputs.shape
        slots = self.slots_mu.expand(b, self.num_slots, -1)
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(self.iters):
            prev = slots
            q = self.to_q(self.norm_slots(slots))
            dots = torch.bmm(q, k.transpose(1, 2)) * self.scale
            dots = dots.masked_fill(~mask[:, None, :], -1e9)
            attn = dots.softmax(dim=1)
            attn = attn * mask[:, None, :].float()
            attn = attn / (attn.sum(dim=-1, keepdim=True) + self.eps)
            updates = torch.bmm(attn, v)
            slots = self.gru(updates.reshape(-1, d), prev.reshape(-1, d)).reshape(b, -1, d)
        return slots


def dual_softmax(feat0, feat1, mask0, mask1, temperature=0.1):
    sim = torch.einsum("nlc,nsc->nls", feat0, feat1) / temperature
    sim = sim.masked_fill(~(mask0[:, :, None] & mask1[:, None, :]), -1e9)
    return torch.softmax(sim, 1) * torch.softmax(sim, 2)


lengths = torch.tensor([7, 4, 5])
mask = torch.arange(7)[None, :] < lengths[:, None]
inputs = torch.randn(3, 7, 16) * mask[..., None]
with torch.no_grad():
    slots = SlotAttention()(inputs, mask)

feat0, feat1 = torch.randn(2, 6, 8), torch.randn(2, 10, 8)
mask0 = torch.ones(2, 6, dtype=torch.bool)
mask1 = torch.arange(10)[None, :] < torch.tensor([[10], [7]])
with torch.no_grad():
    conf = dual_softmax(feat0, feat1, mask0, mask1)
print(slots.shape, conf.shape)
