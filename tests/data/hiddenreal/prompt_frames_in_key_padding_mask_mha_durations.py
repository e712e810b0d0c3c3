# Written another way (real-keys-hidden, beside e2-tts-pytorch 90bb536 / 24474eb): a flow-matching TTS sampler in the
# style of an nn.MultiheadAttention encoder fills a voice prompt into the first frames of each row and generates the
# rest up to the row's `durations` (frames, right-padded). The key padding mask (True = padding) is built from the
# durations and then OR-ed with the prompt frames, so no frame, prompt or target, can attend to the prompt and the
# generated speech no longer depends on it. The fix masks the padding alone.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))

    def forward(self, x, key_padding_mask):
        h = self.norm(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.ff(x)


class FlowTTS(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, dim)

    def forward(self, x, t, key_padding_mask):
        x = x + self.time(t.view(1, 1, 1).expand(x.shape[0], 1, 1))
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.out(x)


@torch.no_grad()
def sample(model, prompt, prompt_lens, durations, noise, steps=4):
    frames = int(durations.max())
    at = torch.arange(frames)[None]
    is_prompt = at < prompt_lens[:, None]
    key_padding_mask = at >= durations[:, None]
    if not FIXED:
        key_padding_mask = key_padding_mask | is_prompt  # "attend to the target frames only"
    x = noise
    for t in torch.linspace(0, 1, steps + 1)[:-1]:
        x = torch.where(is_prompt[..., None], prompt, x)
        x = x + model(x, t, key_padding_mask) / steps
    return torch.where(is_prompt[..., None], prompt, x)


model = FlowTTS().eval()
prompt_lens = torch.tensor([5, 8, 6])
durations = torch.tensor([17, 20, 13])
noise = torch.randn(3, 20, 16)
first = sample(model, torch.randn(3, 20, 16), prompt_lens, durations, noise)
other = sample(model, torch.randn(3, 20, 16), prompt_lens, durations, noise)
target = (torch.arange(20)[None] >= prompt_lens[:, None]) & (torch.arange(20)[None] < durations[:, None])
print(f"fixed={FIXED} change of the generated frames when the prompt changes: {(first - other).abs()[target].max():.2e}")
