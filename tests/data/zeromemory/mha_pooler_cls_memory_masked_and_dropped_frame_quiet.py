# Correct programs of the pooler's shape that zero-memory-seen must stay quiet on: an nn.MultiheadAttention pooler
# (batch_first) whose memory is a CLS token PREPENDED to per-frame features. (1) A batch of clips right-padded with
# zero frames, the key_padding_mask built from the lengths and handed to the attention (the CLS key always kept).
# (2) One clip whose frame 3 was dropped by the decoder and left as zeros in the middle of real frames, attended
# with no mask: zeros between real frames are no padding.
import torch
from torch import nn

torch.manual_seed(0)
DIM, FRAMES = 16, 10


class ClsPooler(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, DIM))
        self.query = nn.Parameter(torch.randn(1, 2, DIM))
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)

    def forward(self, frames, lengths=None):
        b = frames.shape[0]
        memory = torch.cat([self.cls.expand(b, -1, -1), frames], dim=1)
        pad = None
        if lengths is not None:
            slots = torch.arange(FRAMES)[None, :] >= lengths[:, None]
            pad = torch.cat([torch.zeros(b, 1, dtype=torch.bool), slots], dim=1)
        out, _ = self.attn(self.query.expand(b, -1, -1), memory, memory, key_padding_mask=pad)
        return out.mean(1)


pooler = ClsPooler().eval()
lengths = torch.tensor([10, 4, 7])
clips = torch.zeros(3, FRAMES, DIM)
for i, n in enumerate(lengths.tolist()):
    clips[i, :n] = torch.randn(n, DIM)
one = torch.randn(1, FRAMES, DIM)
one[0, 3] = 0  # a dropped frame, between real ones
with torch.no_grad():
    print(pooler(clips, lengths).shape, pooler(one).shape)
