# Ports keras/src/layers/attention/multi_head_attention.py (MultiHeadAttention._compute_attention_mask: query_mask &
# value_mask, True = attend) to torch.nn.MultiheadAttention, which wants True = NOT allowed, so the mask is flipped.
# Cross-attention: 7 queries over 4 keys; padded query rows are recomputed alone for the reference.
import torch
torch.manual_seed(0)
E, H = 16, 2
mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
query = torch.randn(2, 7, E, dtype=torch.float64)
value = torch.randn(2, 4, E, dtype=torch.float64)
qlens, vlens = [7, 5], [4, 2]
query_mask = torch.arange(7)[None] < torch.tensor(qlens)[:, None]
value_mask = torch.arange(4)[None] < torch.tensor(vlens)[:, None]
keras_mask = query_mask[:, :, None] & value_mask[:, None, :]          # [B,Tq,Tv], True = attend
keras_mask = keras_mask | ~query_mask[:, :, None]                      # pad query rows: let them see all (discarded)
attn_mask = (~keras_mask).repeat_interleave(H, 0)                      # torch: True = masked
with torch.no_grad():
    out, _ = mha(query, value, value, attn_mask=attn_mask)
    diff = 0.0
    for b in range(2):
        r, _ = mha(query[b:b+1, :qlens[b]], value[b:b+1, :vlens[b]], value[b:b+1, :vlens[b]])
        diff = max(diff, (r - out[b:b+1, :qlens[b]]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
