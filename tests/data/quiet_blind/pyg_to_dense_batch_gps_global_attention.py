# Follows pyg-team/pytorch_geometric torch_geometric/utils/_to_dense_batch.py (to_dense_batch) and
# torch_geometric/nn/conv/gps_conv.py GPSConv.forward: h, mask = to_dense_batch(x, batch);
# attn(h, h, h, key_padding_mask=~mask) (mask True = real node, flipped to True = ignore); h = h[mask] drops pad rows.
import torch
torch.manual_seed(2); torch.set_default_dtype(torch.float64)
D, H = 32, 4

def to_dense_batch(x, batch, fill_value=0.0):
    batch_size = int(batch.max()) + 1
    num_nodes = torch.bincount(batch, minlength=batch_size)
    cum_nodes = torch.cat([num_nodes.new_zeros(1), num_nodes.cumsum(0)])
    max_num_nodes = int(num_nodes.max())
    idx = torch.arange(batch.size(0)) - cum_nodes[batch] + batch * max_num_nodes
    out = x.new_full((batch_size * max_num_nodes, x.size(-1)), fill_value)
    out[idx] = x
    mask = torch.zeros(batch_size * max_num_nodes, dtype=torch.bool)
    mask[idx] = True
    return out.view(batch_size, max_num_nodes, -1), mask.view(batch_size, max_num_nodes)

attn = torch.nn.MultiheadAttention(D, H, batch_first=True, dropout=0.0)
norm = torch.nn.LayerNorm(D)
def global_block(x, batch):
    h, mask = to_dense_batch(x, batch)
    h, _ = attn(h, h, h, attn_mask=None, key_padding_mask=~mask, need_weights=False)
    h = h[mask]
    return norm(h + x)

sizes = [7, 3, 11, 1]
batch = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
x = torch.randn(batch.numel(), D)
with torch.no_grad():
    out = global_block(x, batch)
    refs, start = [], 0
    for n in sizes:                       # each graph alone, no padding at all
        xi = x[start:start + n]
        hi, _ = attn(xi[None], xi[None], xi[None], need_weights=False)
        refs.append(norm(hi[0] + xi)); start += n
    diff = (out - torch.cat(refs)).abs().max().item()
print("max diff dense-batched vs per-graph:", diff)
assert diff < 1e-10
