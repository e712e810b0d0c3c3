"""A Perceiver resampler as lucidrains/perceiver-pytorch (perceiver_pytorch.py) and Flamingo's resampler write it:
learned latents cross-attend to the media frames (`Attention(x, context=data, mask=mask)`, the frames' padding
masked as keys), then attend to themselves (`Attention(x)`: `context = default(context, x)`, no mask). The frames'
padding is handed in as the model's `attention_mask` (1 = a real frame).

The masks are right: no latent sees a padded frame, and the latents see each other, all of them real. Here there
are as many latents as frames (4 and 4), so the latents' self-attention has the frames' length; yet its keys are
latents, not frames: frame 2 of row 1 being padding says nothing of latent 2."""
import torch
from torch import nn


def default(value, fallback):
    return fallback if value is None else value


class Attention(nn.Module):
    def __init__(self, query_dim=16, heads=2, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(query_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None, mask=None):
        b, n, _ = x.shape
        context = default(context, x)
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, context.shape[1], self.heads, -1).transpose(1, 2) for t in self.to_kv(context).chunk(2, dim=-1))
        sim = q @ k.transpose(-1, -2) * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        out = (sim.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Perceiver(nn.Module):
    def __init__(self, dim=16, num_latents=4, depth=2):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, dim))
        self.layers = nn.ModuleList(nn.ModuleList([Attention(dim), Attention(dim)]) for _ in range(depth))

    def forward(self, data, attention_mask=None):
        x = self.latents.unsqueeze(0).expand(data.shape[0], -1, -1)
        mask = None if attention_mask is None else attention_mask.bool()
        for cross_attn, self_attn in self.layers:
            x = cross_attn(x, context=data, mask=mask) + x
            x = self_attn(x) + x
        return x


def main():
    torch.manual_seed(0)
    frames = torch.randn(2, 4, 16)
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # row 1: its last two frames are padding
    with torch.no_grad():
        out = Perceiver().eval()(frames, attention_mask=attention_mask)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
