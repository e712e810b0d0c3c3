# Follows wenet/utils/mask.py subsequent_chunk_mask + add_optional_chunk_mask and
# MultiHeadedAttention.forward_attention (masked_fill(~mask, -inf) then softmax, then masked_fill(~mask, 0)):
# frame i sees all frames up to the end of its chunk. Full chunk-masked pass vs chunk-by-chunk streaming with a KV cache.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
T, D, H, C = 20, 32, 4, 6
def subsequent_chunk_mask(size, chunk_size):
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, 0:ending] = True
    return ret
Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def split(t): return t.view(1, -1, H, D // H).transpose(1, 2)
def forward_attention(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / (D // H) ** .5
    scores = scores.masked_fill(~mask, float("-inf"))
    attn = torch.softmax(scores, -1).masked_fill(~mask, 0.0)
    return attn @ v
x = torch.randn(1, T, D)
full = forward_attention(split(x @ Wq), split(x @ Wk), split(x @ Wv), subsequent_chunk_mask(T, C)[None, None])
sdpa = torch.nn.functional.scaled_dot_product_attention(split(x @ Wq), split(x @ Wk), split(x @ Wv),
                                                         attn_mask=subsequent_chunk_mask(T, C))
kc = vc = None; outs = []
for s in range(0, T, C):
    xc = x[:, s:s + C]; k, v = split(xc @ Wk), split(xc @ Wv)
    kc = k if kc is None else torch.cat([kc, k], 2); vc = v if vc is None else torch.cat([vc, v], 2)
    m = torch.ones(1, 1, xc.shape[1], kc.shape[2], dtype=torch.bool)  # whole chunk + cache visible
    outs.append(forward_attention(split(xc @ Wq), kc, vc, m))
stream = torch.cat(outs, 2)
diff = max((stream - full).abs().max().item(), (sdpa - full).abs().max().item())
print("max diff chunk mask vs streaming cache (and vs SDPA)", diff); assert diff < 1e-10
