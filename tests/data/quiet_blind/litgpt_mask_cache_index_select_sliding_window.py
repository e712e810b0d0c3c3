# Follows LitGPT litgpt/model.py build_mask_cache (tril bool, True = attend), CausalSelfAttention.forward
# (mask = mask_cache.index_select(2, input_pos) over a max_seq_length KVCache filled with index_copy_) and the
# sliding-window layer: without a cache the Gemma-2 path builds a float triu(-inf) bias plus tril(-window) -inf bias;
# with a cache a second mask cache (tril & triu(1-window), absolute positions) is index_selected at input_pos.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def build_mask_cache(max_seq_length, sliding_window_size=None, device=None):
    ones = torch.ones((max_seq_length, max_seq_length), device=device, dtype=torch.bool)
    mask = torch.tril(ones)
    if sliding_window_size is not None:
        mask = mask & torch.triu(ones, diagonal=1 - sliding_window_size)
    return mask.unsqueeze(0).unsqueeze(0)


class KVCache:
    def __init__(self, k_shape, v_shape):
        self.k = torch.zeros(k_shape)
        self.v = torch.zeros(v_shape)

    def forward(self, input_pos, k, v):
        k = self.k.index_copy_(2, input_pos, k)
        v = self.v.index_copy_(2, input_pos, v)
        return k, v


d_model, H, n_layer, max_seq_length, sliding_window_size = 32, 4, 2, 16, 4
Dh = d_model // H
Ws = [[torch.randn(d_model, d_model) / d_model ** 0.5 for _ in range(4)] for _ in range(n_layer)]
sliding = [False, True]  # layer 1 is a local (sliding-window) layer


def scaled_dot_product_attention(q, k, v, mask, apply_sliding_window_attention):
    if apply_sliding_window_attention:
        if mask is not None:  # cached decode: window already in the absolute-position sliding mask cache
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask = torch.ones(q.size(2), q.size(2), dtype=q.dtype).triu(diagonal=1)
        mask.masked_fill_(mask.bool(), float("-inf"))
        mask = mask.view(1, 1, *mask.shape)
        sliding_window_bias = torch.ones_like(mask).tril(diagonal=-sliding_window_size)
        sliding_window_bias.masked_fill_(sliding_window_bias.bool(), float("-inf"))
        mask = mask + sliding_window_bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def forward(x, input_pos=None, mask_caches=None, caches=None):
    B, T, _ = x.shape
    for l, (wq, wk, wv, wo) in enumerate(Ws):
        q = (x @ wq).view(B, T, H, Dh).transpose(1, 2)
        k = (x @ wk).view(B, T, H, Dh).transpose(1, 2)
        v = (x @ wv).view(B, T, H, Dh).transpose(1, 2)
        mask = None
        if input_pos is not None:
            k, v = caches[l].forward(input_pos, k, v)
            mask = mask_caches[sliding[l]].index_select(2, input_pos)
        y = scaled_dot_product_attention(q, k, v, mask, sliding[l])
        x = x + y.transpose(1, 2).reshape(B, T, d_model) @ wo
    return x


B, total = 2, 13
x = torch.randn(B, total, d_model)
mask_caches = {False: build_mask_cache(max_seq_length), True: build_mask_cache(max_seq_length, sliding_window_size)}
caches = [KVCache((B, H, max_seq_length, Dh), (B, H, max_seq_length, Dh)) for _ in range(n_layer)]
prefill = 5
outs = [forward(x[:, :prefill], torch.arange(prefill), mask_caches, caches)]
for t in range(prefill, total):
    outs.append(forward(x[:, t:t + 1], torch.tensor([t]), mask_caches, caches))
cached = torch.cat(outs, 1)
full = forward(x)  # no cache: mask=None path (is_causal / float triu bias)

# explicit per-query loop reference for the two layers
def loop_ref(x):
    B, T, _ = x.shape
    for l, (wq, wk, wv, wo) in enumerate(Ws):
        q = (x @ wq).view(B, T, H, Dh)
        k = (x @ wk).view(B, T, H, Dh)
        v = (x @ wv).view(B, T, H, Dh)
        y = torch.zeros(B, T, H, Dh)
        for i in range(T):
            lo = max(0, i - sliding_window_size + 1) if sliding[l] else 0
            s = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, lo:i + 1]) / Dh ** 0.5
            y[:, i] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v[:, lo:i + 1])
        x = x + y.reshape(B, T, d_model) @ wo
    return x

ref = loop_ref(x)
diff = max((cached - ref).abs().max().item(), (full - ref).abs().max().item())
print(f"max abs diff (KV-cached and uncached vs per-query loop): {diff:.3e}")
assert diff < 1e-12
