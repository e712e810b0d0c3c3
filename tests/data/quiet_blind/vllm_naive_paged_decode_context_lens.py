# Follows vllm tests/kernels/test_attention.py (ref_single_query_cached_kv_attention) as the reference, and a
# batched fallback: gather blocks by block_tables, pad to max context, key mask arange(max_ctx) < context_lens.
import torch, torch.nn.functional as F
torch.manual_seed(0)
H, Dh, bs, nblocks = 2, 8, 4, 16
key_cache = torch.randn(nblocks, bs, H, Dh, dtype=torch.float64)
value_cache = torch.randn(nblocks, bs, H, Dh, dtype=torch.float64)
context_lens = torch.tensor([5, 11, 1])
block_tables = torch.tensor([[3, 7, 0], [9, 2, 14], [5, 0, 0]])   # unused tail entries point at block 0
q = torch.randn(3, H, Dh, dtype=torch.float64)
max_ctx = block_tables.shape[1] * bs
k = key_cache[block_tables].reshape(3, max_ctx, H, Dh).transpose(1, 2)
v = value_cache[block_tables].reshape(3, max_ctx, H, Dh).transpose(1, 2)
keep = (torch.arange(max_ctx)[None, :] < context_lens[:, None])[:, None, None, :]   # True = attend
out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep).squeeze(2)
ref = torch.empty_like(q)
for i in range(3):
    ks, vs = [], []
    for j in range(context_lens[i].item()):
        blk = block_tables[i, j // bs]; off = j % bs
        ks.append(key_cache[blk, off]); vs.append(value_cache[blk, off])
    K, V = torch.stack(ks), torch.stack(vs)                        # [L,H,Dh]
    w = torch.softmax(torch.einsum("hd,lhd->hl", q[i], K) / Dh ** 0.5, -1)
    ref[i] = torch.einsum("hl,lhd->hd", w, V)
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
