"""A decoder block whose cross-attention falls back to the decoder's attention_mask for the encoder's keys.

Written as Hugging Face decoders write it (`encoder_hidden_states`, `encoder_attention_mask`), left-padded decoder
tokens, SDPA with a bool keep-mask. Bug: `encoder_attention_mask or attention_mask`; fix: no mask for an unpadded
encoder output."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class CrossAttention(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, encoder_attention_mask=None):
        b, n, d = hidden_states.shape
        q = self.q(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(encoder_hidden_states).view(b, -1, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if FIXED:
            keys = encoder_attention_mask
        else:
            keys = encoder_attention_mask if encoder_attention_mask is not None else attention_mask
        attn_mask = None if keys is None else keys[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    block = CrossAttention().eval()
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    hidden, encoded = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    with torch.no_grad():
        out = block(hidden, encoder_hidden_states=encoded, attention_mask=attention_mask)
    print("checksum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
