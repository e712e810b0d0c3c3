"""An audio-text encoder whose evaluation loop holds the clips' `audio_mask` and calls the model without it.

Written for maskcli's tests, as audio-language encoders (CLAP-style fusion: audio frames then text tokens, one
bidirectional nn.MultiheadAttention) write it: `audio_mask` (B, F) True = a real audio frame, the short clip's
frames left-padded; the model takes `audio_mask=None` and builds the key padding from it. Bug: `evaluate` holds the
mask as a local and never passes it, so the padded frames are attended. Fixed: `model(..., audio_mask=audio_mask)`.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Fusion(nn.Module):
    def __init__(self, dim=32, heads=4, vocab=20):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, input_ids, audio_embeds, audio_mask=None):
        x = torch.cat([audio_embeds, self.embed(input_ids)], dim=1)
        padding = None
        if audio_mask is not None:
            text = torch.zeros(input_ids.shape, dtype=torch.bool)
            padding = torch.cat([~audio_mask, text], dim=1)  # True = padding
        out, _ = self.attn(x, x, x, key_padding_mask=padding, need_weights=False)
        return out


def evaluate(model, clips, input_ids):
    audio_mask = torch.tensor([[True, True, True, True], [False, False, True, True]])
    audio_embeds = clips * audio_mask[:, :, None]
    with torch.no_grad():
        if FIXED:
            return model(input_ids, audio_embeds, audio_mask=audio_mask)
        return model(input_ids, audio_embeds)


if __name__ == "__main__":
    torch.manual_seed(0)
    out = evaluate(Fusion().eval(), torch.randn(2, 4, 32), torch.tensor([[3, 4, 5], [6, 7, 8]]))
    print("fused", tuple(out.shape))
