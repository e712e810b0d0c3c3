# Written here (not a published bug): pooled-over-padding on a pooling no model call runs, written another way than
# s3prl#579. An upstream encoder (nn.TransformerEncoder, its key padding handed) encodes a right-padded batch of three
# utterances (10, 6 and 3 frames of 10); a self-attention pooling head, called on its own afterwards, is handed the
# lengths but never masks its weights, so the padded frames take weight. The fix fills them with -inf.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttentionPooling(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, frames, frame_lens):
        logits = self.score(frames).squeeze(-1)
        if FIXED:
            real = torch.arange(frames.shape[1])[None, :] < frame_lens[:, None]
            logits = logits.masked_fill(~real, float("-inf"))
        weights = torch.softmax(logits, dim=-1).unsqueeze(-1)
        return (frames * weights).sum(dim=1)


frame_lens = torch.tensor([10, 6, 3])
frames = torch.randn(3, 10, 16)
pad = torch.arange(10)[None, :] >= frame_lens[:, None]
layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
upstream = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
head = SelfAttentionPooling(16)
with torch.no_grad():
    hidden = upstream(frames, src_key_padding_mask=pad)
    pooled = head(hidden, frame_lens)
print("pooled norms:", [round(float(n), 4) for n in pooled.norm(dim=-1)])
