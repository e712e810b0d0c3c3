"""Slot Attention: 5 slots compete for 64 image features; softmax over the slots, not the keys.

Follows lucidrains/slot-attention slot_attention/slot_attention.py (SlotAttention.forward:
`attn = dots.softmax(dim=1) + eps`, `attn = attn / attn.sum(dim=-1, keepdim=True)`) with a small CNN
encoder and soft position embedding as in the Slot Attention object-discovery setup. The slots are
the queries and the 8x8 = 64 feature positions the keys. The softmax runs over the query axis so
that slots compete for each input position; the result is then renormalized over the keys as a
weighted mean. No position is excluded: the attention is dense and unmasked by design.
Mask meant: none, [5 slots x 64 inputs] dense, normalized over slots (dim=1) then over inputs.
"""
import torch
from torch import nn
from torch.nn import init


class SlotAttention(nn.Module):
    def __init__(self, num_slots, dim, iters=3, eps=1e-8, hidden_dim=64):
        super().__init__()
        self.num_slots = num_slots
        self.iters = iters
        self.eps = eps
        self.scale = dim ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_logsigma = nn.Parameter(torch.zeros(1, 1, dim))
        init.xavier_uniform_(self.slots_logsigma)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.gru = nn.GRUCell(dim, dim)
        hidden_dim = max(dim, hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, dim))
        self.norm_input = nn.LayerNorm(dim)
        self.norm_slots = nn.LayerNorm(dim)
        self.norm_pre_ff = nn.LayerNorm(dim)

    def forward(self, inputs, num_slots=None):
        b, n, d = inputs.shape
        n_s = num_slots if num_slots is not None else self.num_slots
        mu = self.slots_mu.expand(b, n_s, -1)
        sigma = self.slots_logsigma.exp().expand(b, n_s, -1)
        slots = mu + sigma * torch.randn(mu.shape, dtype=inputs.dtype)
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(self.iters):
            slots_prev = slots
            slots = self.norm_slots(slots)
            q = self.to_q(slots)
            dots = torch.einsum("bid,bjd->bij", q, k) * self.scale
            # slots compete for every input position: normalize over the slot axis
            attn = dots.softmax(dim=1) + self.eps
            attn = attn / attn.sum(dim=-1, keepdim=True)
            updates = torch.einsum("bjd,bij->bid", v, attn)
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d))
            slots = slots.reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        return slots


def build_grid(resolution):
    ranges = [torch.linspace(0.0, 1.0, steps=r) for r in resolution]
    grid = torch.stack(torch.meshgrid(*ranges, indexing="ij"), dim=-1)
    return torch.cat([grid, 1.0 - grid], dim=-1)[None]


class SoftPositionEmbed(nn.Module):
    def __init__(self, hidden_size, resolution):
        super().__init__()
        self.embedding = nn.Linear(4, hidden_size)
        self.register_buffer("grid", build_grid(resolution))

    def forward(self, inputs):
        return inputs + self.embedding(self.grid)


class SlotAttentionAutoEncoderEncoder(nn.Module):
    def __init__(self, resolution=(8, 8), num_slots=5, hid_dim=32, iters=3):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, hid_dim, 5, padding=2), nn.ReLU(),
                                  nn.Conv2d(hid_dim, hid_dim, 5, padding=2), nn.ReLU())
        self.encoder_pos = SoftPositionEmbed(hid_dim, resolution)
        self.fc = nn.Sequential(nn.LayerNorm(hid_dim), nn.Linear(hid_dim, hid_dim), nn.ReLU(),
                                nn.Linear(hid_dim, hid_dim))
        self.slot_attention = SlotAttention(num_slots=num_slots, dim=hid_dim, iters=iters)

    def forward(self, image):
        x = self.conv(image).permute(0, 2, 3, 1)
        x = self.encoder_pos(x).flatten(1, 2)
        return self.slot_attention(self.fc(x))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = SlotAttentionAutoEncoderEncoder().eval()
    image = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        slots = model(image)
    print("slots", tuple(slots.shape))
