"""An audio encoder over a batch of lengths: nn.MultiheadAttention's key_padding_mask built the other way round
(True = a real frame, where MHA ignores True)."""
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, feats, lengths):
        frames = torch.arange(feats.shape[1], device=feats.device)
        valid = frames[None, :] < lengths[:, None]
        out, _ = self.attn(feats, feats, feats, key_padding_mask=~valid if FIXED else valid, need_weights=False)
        return out


torch.manual_seed(0)
block = Block().eval()
with torch.no_grad():
    block(torch.randn(3, 6, 8), torch.tensor([6, 4, 2]))
