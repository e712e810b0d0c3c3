# Follows facebookresearch/blt bytelatent/model/blt.py: patch_ids_from_lengths, create_patch_mask_from_ids and
# cross_attn_mask (torch.where(mask, 0, -inf)): encoder patches (queries) read only their own bytes, decoder bytes
# (more queries than keys) read only their own patch. Zero-length pad patches / pad bytes see nothing; rows discarded.
import torch
torch.manual_seed(5)
torch.set_default_dtype(torch.float64)
D = 32

def patch_ids_from_lengths(patch_lengths, seq_len):
    bs, _ = patch_lengths.shape
    cum_d = torch.cat([torch.zeros(bs, 1, dtype=patch_lengths.dtype), patch_lengths.cumsum(-1)], -1)
    return (cum_d.unsqueeze(-1) <= torch.arange(seq_len)).sum(-2) - 1

def create_patch_mask_from_ids(patch_ids, num_patches, patches_as_queries=False):
    bs, seq_len = patch_ids.shape
    if not patches_as_queries:
        q_ids = patch_ids.unsqueeze(-1).expand(bs, seq_len, num_patches)
        kv_ids = torch.arange(num_patches).view(1, 1, -1).expand(bs, seq_len, num_patches)
    else:
        kv_ids = patch_ids.unsqueeze(1).expand(bs, num_patches, seq_len)
        q_ids = torch.arange(num_patches).view(1, -1, 1).expand(bs, num_patches, seq_len)
    return q_ids == kv_ids

def cross_attn_bias(patch_ids, patch_lengths, patches_as_queries):
    m = create_patch_mask_from_ids(patch_ids, patch_lengths.shape[1], patches_as_queries)
    return torch.where(m, torch.tensor(0.0), torch.tensor(float("-inf"))).unsqueeze(1)  # (B,1,q,kv)

Wq_e, Wk_e, Wv_e, Wq_d, Wk_d, Wv_d, Wg = (torch.randn(D, D) / D ** 0.5 for _ in range(7))
P0 = torch.randn(D)   # patch query seed (stand-in for BLT's pooled patch init)

def sdpa_rows(q, k, v, bias):
    # rows whose bias is all -inf give NaN from softmax; they are padding and are zeroed (discarded) right after
    p = torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + bias.squeeze(1), -1)
    out = p @ v
    return torch.where(torch.isnan(out), torch.zeros(()), out)

def model(bytes_h, patch_lengths):
    B, N, _ = bytes_h.shape
    P = patch_lengths.shape[1]
    ids = patch_ids_from_lengths(patch_lengths, N)
    q = (P0 + torch.zeros(B, P, D)) @ Wq_e
    patches = sdpa_rows(q, bytes_h @ Wk_e, bytes_h @ Wv_e, cross_attn_bias(ids, patch_lengths, True))
    # global model: causal over patches (pad patches sit at the end, so causal already hides them from real ones)
    s = (patches @ Wg) @ patches.transpose(-1, -2) / D ** 0.5
    s = s.masked_fill(torch.ones(P, P, dtype=torch.bool).triu(1), float("-inf"))
    g = patches + s.softmax(-1) @ patches
    dec = sdpa_rows(bytes_h @ Wq_d, g @ Wk_d, g @ Wv_d, cross_attn_bias(ids, patch_lengths, False))
    return patches, dec

lengths = [[1, 3, 2, 4, 2], [1, 5, 2, 0, 0]]     # second sequence: 8 bytes, 3 patches, padded to 12 bytes / 5 patches
N = 12
pl = torch.tensor(lengths)
x = torch.randn(2, N, D)
x[1, 8:] = 1e3                                   # pad bytes
patches, dec = model(x, pl)

# reference: each sequence alone with explicit loops over its own bytes / patches
dmax = 0.0
for b, L in enumerate(lengths):
    L = [l for l in L if l > 0]
    n = sum(L)
    starts = [sum(L[:i]) for i in range(len(L))]
    pats = []
    for p, (st, l) in enumerate(zip(starts, L)):
        kv = x[b, st:st + l]
        w = ((kv @ Wk_e) @ (P0 @ Wq_e) / D ** 0.5).softmax(-1)
        pats.append(w @ (kv @ Wv_e))
    pats = torch.stack(pats)
    g = torch.stack([pats[i] + ((pats[:i + 1] @ (pats[i] @ Wg)) / D ** 0.5).softmax(-1) @ pats[:i + 1]
                     for i in range(len(L))])
    for p, (st, l) in enumerate(zip(starts, L)):
        for j in range(st, st + l):   # one key only: softmax weight 1
            ref = g[p] @ Wv_d
            dmax = max(dmax, (dec[b, j] - ref).abs().max().item())
    dmax = max(dmax, (patches[b, :len(L)] - pats).abs().max().item())
print("max diff padded BLT cross-attention vs per-sequence loops:", dmax)
assert dmax < 1e-12
