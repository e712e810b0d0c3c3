"""nanochat's sliding-window attention on its SDPA fallback (CPU / non-Hopper), as karpathy/nanochat
writes it: nanochat/flash_attention.py@bbe1093ac6701dfe0ce65d788469fc0f757502f6 (_get_sliding_window_mask:
bottom-right aligned `row_idx = (Tk - Tq) + arange(Tq)`, `(row_idx - col_idx) <= window`; _sdpa_attention:
`is_causal=True` with no mask when window >= Tq and Tq == Tk, key slicing `start = max(0, Tk - (window+1))`
and NO mask when Tq == 1; flash_attn_with_kvcache: in-place cache insert at cache_seqlens[0]) and
nanochat/gpt.py (window_pattern "SSL" tiled over layers, short = sequence_len // 2, the last layer long;
window_size = (left, 0); rotary then QK RMSNorm; relu^2 MLP; untied head).

Intent: a layer with window w lets a token see itself and the w tokens before it. Three code paths
express it: the explicit bool mask (training with T > w, chunked prefill), is_causal (w >= T), and a
sliced key range with no mask at all (single-token decode).

Checks: (1) the training forward equals a per-query loop that keeps keys j with i - w <= j <= i;
(2) prefill 5 tokens, a chunk of 4, then single-token decode to 16 tokens through the KV cache equals the
training forward's logits at every position.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
SEQ, V, D, H, NL, PATTERN = 16, 48, 32, 4, 3, "SSL"
HD = D // H


def window_sizes():
    long_w, short_w = SEQ, SEQ // 2
    ws = [{"L": (long_w, 0), "S": (short_w, 0)}[PATTERN[i % len(PATTERN)]] for i in range(NL)]
    ws[-1] = (long_w, 0)
    return ws


def sliding_window_mask(Tq, Tk, window):
    row_idx = (Tk - Tq) + torch.arange(Tq).unsqueeze(1)
    col_idx = torch.arange(Tk).unsqueeze(0)
    mask = col_idx <= row_idx
    if window >= 0 and window < Tk:
        mask = mask & ((row_idx - col_idx) <= window)
    return mask


def sdpa_attention(q, k, v, window_size):
    Tq, Tk, window = q.size(2), k.size(2), window_size[0]
    if (window < 0 or window >= Tq) and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if Tq == 1:
        if window >= 0 and window < Tk:
            start = max(0, Tk - (window + 1))
            k, v = k[:, :, start:, :], v[:, :, start:, :]
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_window_mask(Tq, Tk, window))


def loop_attention(q, k, v, window_size):  # reference: explicit per-query window, (B,H,T,D), Tq == Tk
    w, T, out = window_size[0], q.size(2), torch.zeros_like(q)
    for i in range(T):
        lo = max(0, i - w)
        s = q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) / HD ** 0.5
        out[:, :, i:i + 1] = s.softmax(-1) @ v[:, :, lo:i + 1]
    return out


def rotary(x, pos):  # (B,T,H,HD)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).double() / HD))
    f = pos[:, None].double() * inv
    cos, sin = f.cos()[None, :, None], f.sin()[None, :, None]
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], -1)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Attn(nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.ws = ws
        self.c_q, self.c_k, self.c_v, self.c_proj = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, pos, cache=None, attn=sdpa_attention):
        B, T, _ = x.shape
        q = norm(rotary(self.c_q(x).view(B, T, H, HD), pos))
        k = norm(rotary(self.c_k(x).view(B, T, H, HD), pos))
        v = self.c_v(x).view(B, T, H, HD)
        if cache is not None:                       # flash_attn_with_kvcache SDPA fallback
            k_cache, v_cache, p = cache
            k_cache[:, p:p + T], v_cache[:, p:p + T] = k, v
            k, v = k_cache[:, :p + T], v_cache[:, :p + T]
        y = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.ws)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.attn = nn.ModuleList([Attn(ws) for ws in window_sizes()])
        self.fc = nn.ModuleList([nn.Linear(D, 4 * D, bias=False) for _ in range(NL)])
        self.proj = nn.ModuleList([nn.Linear(4 * D, D, bias=False) for _ in range(NL)])
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, idx, pos0=0, caches=None, attn=sdpa_attention):
        pos = torch.arange(pos0, pos0 + idx.size(1))
        x = norm(self.wte(idx))
        for i in range(NL):
            x = x + self.attn[i](norm(x), pos, None if caches is None else (*caches[i], pos0), attn)
            x = x + self.proj[i](F.relu(self.fc[i](norm(x))).square())
        return self.lm_head(norm(x))


model = GPT().eval()
idx = torch.randint(0, V, (2, SEQ))
with torch.no_grad():
    full = model(idx)
    d1 = (full - model(idx, attn=loop_attention)).abs().max().item()
    caches = [(torch.zeros(2, SEQ, H, HD), torch.zeros(2, SEQ, H, HD)) for _ in range(NL)]
    pieces, p = [], 0
    for n in [5, 4] + [1] * 7:                      # prefill, chunked prefill, single-token decode
        pieces.append(model(idx[:, p:p + n], pos0=p, caches=caches))
        p += n
    d2 = (torch.cat(pieces, 1) - full).abs().max().item()

print(f"window sizes per layer: {window_sizes()}")
print(f"training forward (mask / is_causal) vs per-query window loop: max diff = {d1:.3e}")
print(f"prefill + chunk + sliced-key decode via KV cache vs training forward: max diff = {d2:.3e}")
assert d1 < 1e-12 and d2 < 1e-12
