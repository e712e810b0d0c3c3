# NVIDIA/TransformerEngine#629: TransformerLayer set window_size = (-1, 0) for self_attn_mask_type="causal"
# and passed that same window to the decoder's inter (cross) attention, which then became causal.
# (TE's flash backend applies window_size; here the window is applied as an explicit mask for SDPA.)
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def check_set_window_size(attn_mask_type, window_size=None):
    if "causal" in attn_mask_type:
        if window_size is None:
            window_size = (-1, 0)
    elif window_size is None:
        window_size = (-1, -1)
    return window_size


class DotProductAttention(nn.Module):
    def forward(self, query, key, value, attn_mask_type="no_mask", attention_mask=None, window_size=None):
        window_size = check_set_window_size(attn_mask_type, window_size)
        sq, sk = query.shape[-2], key.shape[-2]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if window_size != (-1, -1):
            # flash-attn semantics: keys in [i + sk - sq - left, i + sk - sq + right]
            i = torch.arange(sq)[:, None] + (sk - sq)
            j = torch.arange(sk)[None, :]
            if window_size[0] >= 0:
                keep &= j >= i - window_size[0]
            if window_size[1] >= 0:
                keep &= j <= i + window_size[1]
        keep = keep[None, None]
        if "padding" in attn_mask_type and attention_mask is not None:
            keep = keep & ~attention_mask  # TE convention: True means masked out
        return F.scaled_dot_product_attention(query, key, value, attn_mask=keep)


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, attention_type="self"):
        super().__init__()
        self.h, self.attention_type = num_heads, attention_type
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key_value = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.core_attention = DotProductAttention()

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, attn_mask_type="causal",
                window_size=None):
        b, s, d = hidden_states.shape
        kv_in = hidden_states if self.attention_type == "self" else encoder_output
        q = self.query(hidden_states).view(b, s, self.h, -1).transpose(1, 2)
        k, v = self.key_value(kv_in).view(b, kv_in.shape[1], 2, self.h, -1).permute(2, 0, 3, 1, 4)
        out = self.core_attention(q, k, v, attn_mask_type=attn_mask_type, attention_mask=attention_mask,
                                  window_size=window_size)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class TransformerLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_type="decoder", self_attn_mask_type="causal",
                 window_size=None):
        super().__init__()
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = check_set_window_size(self_attn_mask_type, window_size)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, "self")
        self.layer_type = layer_type
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(hidden_size, num_attention_heads, "cross")

    def forward(self, hidden_states, encoder_output=None, enc_dec_attn_mask=None):
        x = hidden_states + self.self_attention(hidden_states, attn_mask_type=self.self_attn_mask_type,
                                                window_size=self.window_size)
        if self.layer_type == "decoder":
            inter_window = None if FIXED else self.window_size
            x = x + self.inter_attention(x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                                         attn_mask_type="padding", window_size=inter_window)
        return x


def main():
    torch.manual_seed(0)
    hidden, heads, tgt_len, src_len = 32, 4, 4, 10
    layer = TransformerLayer(hidden, heads, layer_type="decoder", self_attn_mask_type="causal").eval()
    dec = torch.randn(2, tgt_len, hidden)
    enc = torch.randn(2, src_len, hidden)
    src_lengths = torch.tensor([10, 8])
    enc_dec_attn_mask = (torch.arange(src_len)[None, :] >= src_lengths[:, None])[:, None, None, :]
    with torch.no_grad():
        out = layer(dec, encoder_output=enc, enc_dec_attn_mask=enc_dec_attn_mask)
        enc2 = enc.clone()
        enc2[0, 8:] = torch.randn(2, hidden)  # real (unpadded) source tokens of sample 0
        out2 = layer(dec, encoder_output=enc2, enc_dec_attn_mask=enc_dec_attn_mask)
    print(f"first target token's response to the last source tokens: {(out - out2)[0, 0].abs().max().item():.4f}")


if __name__ == "__main__":
    main()
