# Vermeille/Torchelie commit 866bda6 ("fix causal in SelfAttention", same change as e8c5c57), torchelie/nn/llm.py.
# torchelie.nn.SelfAttention(hidden_size, num_heads, head_size, causal=True) takes a `causal` flag and an optional
# kv_cache, and calls F.scaled_dot_product_attention(q, k, v, is_causal=kv_cache is None or self.causal). Without a
# cache the expression is always True, so a layer built with causal=False (an encoder, a classifier over the whole
# sequence) still runs a causal mask: every token sees only the tokens before it. Fix:
# is_causal=kv_cache is not None or self.causal.
# Below: Torchelie's Rotary and SelfAttention as of the parent commit (tu.normal_init / tu.xavier written inline), used
# as the token mixer of a small bidirectional encoder (pre-norm blocks) that classifies a sequence and predicts a
# masked token, run on a batch of token ids without padding.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# --- torchelie/utils.py (the two initialisers SelfAttention uses) ---
def xavier(m, a=0, nonlinearity='relu', dynamic=False):
    assert isinstance(m.weight, torch.Tensor)
    nn.init.xavier_normal_(m.weight)
    if hasattr(m, 'biais') and m.bias is not None:
        nn.init.constant_(m.bias, 0)
    return m


def normal_init(m, std=0.02):
    assert isinstance(m.weight, torch.Tensor)
    nn.init.normal_(m.weight, 0, std)
    if hasattr(m, 'biais') and m.bias is not None:
        nn.init.constant_(m.bias, 0)
    return m


# --- torchelie/nn/llm.py ---
class Rotary(torch.nn.Module):

    def __init__(self, dim, base=10000):
        """
        Rotary Positional Embedding
        Assumes input of shape (..., seq_len, dim)
        """
        super().__init__()
        inv_freq = 1.0 / (base**(torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, q, k, v, seq_dim=-2):
        seq_len = q.shape[seq_dim]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(q.shape[seq_dim],
                             device=q.device).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(q.device)
            self.cos_cached = emb.cos()[:, :]
            self.sin_cached = emb.sin()[:, :]
        return self.apply_rotary_pos_emb(q, k, v, self.cos_cached,
                                         self.sin_cached)

    def rotate_half(self, x):
        x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=x1.ndim - 1)

    def apply_rotary_pos_emb(self, q, k, v, cos, sin):
        return (q * cos) + (self.rotate_half(q) *
                            sin), (k * cos) + (self.rotate_half(k) * sin), v


class SelfAttention(nn.Module):
    """
    Self-attention layer
    Assumes input of shape (b, l, hidden_size). Uses scaled dot-product
    attention and rotary positional embeddings.

    Args:
        hidden_size (int): size of the hidden dimension
        num_heads (int): number of heads
        head_size (int): size of each head
        causal (bool, optional): whether to apply causal masking. Defaults to True.
    """

    def __init__(self, hidden_size, num_heads, head_size, causal=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.qkv = normal_init(
            nn.Linear(hidden_size, head_size * num_heads * 3, bias=False),
            math.sqrt(2 / (5 * hidden_size)))
        self.fc = xavier(
            nn.Linear(head_size * num_heads, hidden_size, bias=False))
        self.rotary = Rotary(head_size)
        self.causal = causal

    def forward(self, x, kv_cache=None):
        b, l, h, d = x.shape[0], x.shape[1], self.num_heads, self.head_size
        # bld -> (q/k/v)bhld
        qkv = self.qkv(x).reshape(b, l, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if kv_cache is not None:
            # update k, v
            k, v = (torch.cat([kv_cache[0], k],
                              dim=2), torch.cat([kv_cache[1], v], dim=2))
            # update cache
            kv_cache[:] = [k, v]
        q, k, v = self.rotary(q, k, v)
        if FIXED:
            att = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=kv_cache is not None or self.causal)
        else:
            att = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=kv_cache is None or self.causal)
        # bhld -> blhd
        att = att.permute(0, 2, 1, 3).contiguous().reshape(b, l, h * d)
        return self.fc(att)

    def extra_repr(self):
        return f"hidden_size={self.qkv.in_features}, num_heads={self.num_heads}, head_size={self.head_size}, causal={self.causal}"


# --- a small bidirectional encoder built on it ---
class EncoderBlock(nn.Module):

    def __init__(self, hidden_size, num_heads, head_size):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.attn = SelfAttention(hidden_size, num_heads, head_size, causal=False)
        self.norm2 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class Encoder(nn.Module):

    def __init__(self, vocab_size, hidden_size, num_heads, head_size, num_layers, num_classes):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            [EncoderBlock(hidden_size, num_heads, head_size) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size)
        self.cls_head = nn.Linear(hidden_size, num_classes)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.lm_head(x), self.cls_head(x.mean(dim=1))


def main():
    torch.manual_seed(0)
    vocab_size, mask_id = 32, 1
    model = Encoder(vocab_size, hidden_size=32, num_heads=4, head_size=8, num_layers=2, num_classes=3).eval()

    ids = torch.randint(2, vocab_size, (2, 7))
    targets = ids.clone()
    ids[:, 0] = mask_id  # masked-token prediction at the first position
    ids[:, 3] = mask_id
    labels = torch.tensor([0, 2])

    with torch.no_grad():
        token_logits, class_logits = model(ids)
    mlm_loss = nn.functional.cross_entropy(token_logits[:, [0, 3]].reshape(-1, vocab_size),
                                           targets[:, [0, 3]].reshape(-1))
    cls_loss = nn.functional.cross_entropy(class_logits, labels)
    print("masked-token predictions (pos 0, 3):", token_logits[:, [0, 3]].argmax(-1).tolist())
    print("masked-token loss: %.6f" % mlm_loss.item())
    print("class logits:", [[round(v, 5) for v in row] for row in class_logits.tolist()])
    print("class loss: %.6f" % cls_loss.item())


if __name__ == "__main__":
    main()
