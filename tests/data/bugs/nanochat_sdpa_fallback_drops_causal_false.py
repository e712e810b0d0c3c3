# karpathy/nanochat#805 (commit f8781ab, "fix: honor non-causal SDPA attention"): the SDPA fallback of
# nanochat/flash_attention.py ignored causal=False and always ran is_causal=True for full-context attention.
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- nanochat/flash_attention.py (SDPA fallback, no FA3 on CPU) ----
def _sdpa_attention(q, k, v, window_size, enable_gqa, causal=True):
    Tq = q.size(2)
    Tk = k.size(2)
    window = window_size[0]
    if (window < 0 or window >= Tq) and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)
    if Tq == 1:
        if window >= 0 and window < Tk:
            start = max(0, Tk - (window + 1))
            k = k[:, :, start:, :]
            v = v[:, :, start:, :]
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)
    device = q.device
    row_idx = (Tk - Tq) + torch.arange(Tq, device=device).unsqueeze(1)
    col_idx = torch.arange(Tk, device=device).unsqueeze(0)
    mask = col_idx <= row_idx
    if window >= 0 and window < Tk:
        mask = mask & ((row_idx - col_idx) <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    enable_gqa = q.size(1) != k.size(1)
    if FIXED:
        y = _sdpa_attention(q, k, v, window_size, enable_gqa, causal=causal)
    else:
        y = _sdpa_attention(q, k, v, window_size, enable_gqa)
    return y.transpose(1, 2)


flash_attn = SimpleNamespace(flash_attn_func=flash_attn_func)


# ---- a bidirectional (non-causal) attention block using the shim ----
def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class BidirectionalSelfAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_kv_head=2):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.c_q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = norm(q), norm(k)
        y = flash_attn.flash_attn_func(q, k, v, causal=False, window_size=(-1, -1))
        return self.c_proj(y.contiguous().view(B, T, -1))


class Encoder(nn.Module):
    def __init__(self, vocab_size=50, n_embd=32, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.attn = nn.ModuleList([BidirectionalSelfAttention(n_embd) for _ in range(n_layer)])
        self.head = nn.Linear(n_embd, 2, bias=False)

    def forward(self, idx):
        x = norm(self.wte(idx))
        for attn in self.attn:
            x = x + attn(norm(x))
        return self.head(norm(x)[:, 0])  # classify from the first token, which must see the whole sequence


def main():
    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 50, (4, 12))
    labels = torch.randint(0, 2, (4,))
    loss = F.cross_entropy(model(idx), labels)
    loss.backward()
    opt.step()

    model.eval()
    with torch.no_grad():
        a = model(idx)
        changed = idx.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 50
        b = model(changed)
    print(f"loss={loss.item():.4f}  change of first-token logits when the last token changes: "
          f"{(a - b).abs().max().item():.6f} (0 means the encoder is blind to later tokens)")


if __name__ == "__main__":
    main()
