# Follows torchtune torchtune/modules/attention_utils.py create_block_causal_mask (torch.block_diag of per-sample
# tril blocks, True = attend) and datasets/_packed.py PackedDataset: padding is appended as one more "sequence" in
# seq_lens and input_pos restarts at 0 for each document; outputs at pad positions are discarded.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def create_block_causal_mask(seq_lens):
    batch_block_attn_masks = []
    for sample_seq_lens in seq_lens:
        block_attn_masks = [torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in sample_seq_lens]
        batch_block_attn_masks.append(torch.block_diag(*block_attn_masks))
    return torch.stack(batch_block_attn_masks)


def rope(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2) / d)
    ang = pos[..., None].to(x.dtype) * inv  # [B, S, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


d_model, H = 32, 4
Dh = d_model // H
wq, wk, wv, wo = (torch.randn(d_model, d_model) / d_model ** 0.5 for _ in range(4))


def attn(x, pos, mask=None, causal=False):
    B, S, _ = x.shape
    q = rope((x @ wq).view(B, S, H, Dh).transpose(1, 2), pos)
    k = rope((x @ wk).view(B, S, H, Dh).transpose(1, 2), pos)
    v = (x @ wv).view(B, S, H, Dh).transpose(1, 2)
    m = None if mask is None else mask[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
    return o.transpose(1, 2).reshape(B, S, d_model) @ wo


max_seq_len = 20
docs = [[5, 7, 3], [9, 4]]  # per-pack document lengths; remainder is padding
seq_lens, input_pos = [], []
for lens in docs:
    pad = max_seq_len - sum(lens)
    sl = lens + ([pad] if pad > 0 else [])
    seq_lens.append(sl)
    input_pos.append(torch.cat([torch.arange(n) for n in sl]))
input_pos = torch.stack(input_pos)
x = torch.randn(len(docs), max_seq_len, d_model)
mask = create_block_causal_mask(seq_lens)
packed = attn(x, input_pos, mask)

diff = 0.0
for b, lens in enumerate(docs):
    start = 0
    for n in lens:
        alone = attn(x[b:b + 1, start:start + n], torch.arange(n)[None], causal=True)
        diff = max(diff, (packed[b, start:start + n] - alone[0]).abs().max().item())
        start += n
print(f"max abs diff (packed block-causal vs each document alone): {diff:.3e}")
assert diff < 1e-12
