# Correct program (quiet batch quiet-r71b).
# Citation: deepspeedai/DeepSpeed deepspeed/ops/sparse_attention/sparsity_config.py @985acb15cbca1e2b66683f56208b9b59d780c1fa
#   (SparsityConfig.setup_layout / check_and_propagate_first_head_layout, FixedSparsityConfig.set_local_layout /
#   set_global_layout / make_layout), with the order of operations of deepspeed/ops/sparse_attention/
#   sparse_self_attention.py SparseSelfAttention.forward (sdd matmul on the layout's blocks, block-sparse softmax with
#   scale and key_padding_mask in 'add' mode, dsd matmul) and bert_sparse_self_attention.py (query / key / value
#   projections, transpose_for_scores, the extended BERT mask passed as key_padding_mask). The Triton ops are written
#   here as torch loops over layout.nonzero().
# Masking: a bidirectional Fixed layout (local windows of 2 blocks of 4 tokens, one global block per window, which
#   block per head alternating with num_different_global_patterns = 2, horizontal global rows) decides which 4 x 4
#   score blocks exist at all; a right-padded batch, padded to a multiple of the block, adds (1 - mask) * -10000 to
#   padded keys inside the softmax of every block row.
# Self-check: the outputs at real tokens against a double loop over each sequence's own real tokens that keeps key j
#   for query i when layout[h, i // 4, j // 4] is set; and the layout itself against the Fixed rule written out.
import math

import torch

torch.manual_seed(0)


class SparsityConfig:
    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        if not self.different_layout_per_head:
            layout[1:self.num_heads, :, :] = layout[0, :, :]
        return layout


class FixedSparsityConfig(SparsityConfig):
    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4, num_global_blocks=1,
                 attention="bidirectional", horizontal_global_attention=False, num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = num_local_blocks
        assert num_local_blocks % num_global_blocks == 0
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        assert not (attention != "bidirectional" and horizontal_global_attention)
        self.horizontal_global_attention = horizontal_global_attention
        assert not (num_different_global_patterns > 1 and not different_layout_per_head)
        assert num_different_global_patterns <= num_local_blocks // num_global_blocks
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for i in range(0, num_blocks, self.num_local_blocks):
            end = min(i + self.num_local_blocks, num_blocks)
            for row in range(i, end):
                for col in range(i, (row + 1 if self.attention == "unidirectional" else end)):
                    layout[h, row, col] = 1
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        first_global_block_idx = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        end = num_blocks - (num_blocks % self.num_local_blocks)
        for i in range(first_global_block_idx, end, self.num_local_blocks):
            first_row = 0 if self.attention == "bidirectional" else i
            layout[h, first_row:, i:i + self.num_global_blocks] = 1
            if self.horizontal_global_attention:
                layout[h, i:i + self.num_global_blocks, :] = 1
        if end < num_blocks:
            start = min(end + first_global_block_idx, num_blocks - self.num_global_blocks)
            end = start + self.num_global_blocks
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_local_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def sparse_dot_sdd_nt(layout, block, a, b):
    """scores only on the layout's blocks: (B, nnz, block, block), nnz in layout.nonzero() order."""
    blocks = []
    for h, r, c in layout.nonzero().tolist():
        blocks.append(a[:, h, r * block:(r + 1) * block] @ b[:, h, c * block:(c + 1) * block].transpose(-1, -2))
    return torch.stack(blocks, dim=1)


def sparse_softmax(layout, block, x, scale=1.0, key_padding_mask=None, key_padding_mask_mode="add"):
    """softmax over each block row of the sparse matrix, the key padding mask added per key column."""
    nz = layout.nonzero().tolist()
    x = x * scale
    if key_padding_mask is not None:
        kp = key_padding_mask
        if key_padding_mask_mode == "mul":
            kp = torch.where(kp == 0, -float("inf"), 0.0)
        cols = torch.stack([kp[:, c * block:(c + 1) * block] for _, _, c in nz], dim=1)   # (B, nnz, block)
        x = x + cols[:, :, None, :]
    out = torch.empty_like(x)
    rows = {}
    for idx, (h, r, c) in enumerate(nz):
        rows.setdefault((h, r), []).append(idx)
    for (h, r), idxs in rows.items():
        row = torch.cat([x[:, i] for i in idxs], dim=-1).softmax(-1)                       # (B, block, n * block)
        for n, i in enumerate(idxs):
            out[:, i] = row[..., n * block:(n + 1) * block]
    return out


def sparse_dot_dsd_nn(layout, block, w, v):
    out = torch.zeros_like(v)
    for idx, (h, r, c) in enumerate(layout.nonzero().tolist()):
        out[:, h, r * block:(r + 1) * block] += w[:, idx] @ v[:, h, c * block:(c + 1) * block]
    return out


class SparseSelfAttention(torch.nn.Module):
    def __init__(self, sparsity_config, key_padding_mask_mode="add", max_seq_length=2048):
        super().__init__()
        self.sparsity_config = sparsity_config
        self.master_layout = sparsity_config.make_layout(max_seq_length)
        self.key_padding_mask_mode = key_padding_mask_mode

    def get_layout(self, L):
        num_blocks = L // self.sparsity_config.block
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def transpose_mask_for_sparse(self, qtype, x, is_key_padding_mask=False):
        x = x.type(qtype)
        if is_key_padding_mask:
            for d in range(x.dim() - 1, 0, -1):
                x = x.squeeze(dim=d)
            return x
        return x.squeeze()

    def forward(self, query, key, value, key_padding_mask=None):
        bsz, num_heads, tgt_len, head_dim = query.size()
        if key_padding_mask is not None:
            key_padding_mask = self.transpose_mask_for_sparse(query.dtype, key_padding_mask, is_key_padding_mask=True)
        layout, block = self.get_layout(tgt_len), self.sparsity_config.block
        scaling = float(head_dim) ** -0.5
        attn_output_weights = sparse_dot_sdd_nt(layout, block, query, key)
        attn_output_weights = sparse_softmax(layout, block, attn_output_weights, scale=scaling,
                                             key_padding_mask=key_padding_mask,
                                             key_padding_mask_mode=self.key_padding_mask_mode)
        return sparse_dot_dsd_nn(layout, block, attn_output_weights, value)


class BertSparseSelfAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, sparsity_config, max_seq_length):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.query = torch.nn.Linear(hidden_size, hidden_size)
        self.key = torch.nn.Linear(hidden_size, hidden_size)
        self.value = torch.nn.Linear(hidden_size, hidden_size)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.size()[:-2], -1)


hidden, heads, block = 32, 4, 4
config = FixedSparsityConfig(num_heads=heads, block=block, different_layout_per_head=True, num_local_blocks=2,
                             num_global_blocks=1, attention="bidirectional", horizontal_global_attention=True,
                             num_different_global_patterns=2)
attn = BertSparseSelfAttention(hidden, heads, config, max_seq_length=32).eval()

# the layout against the Fixed rule written out: same 2-block window, or a global column / row for this head
layout = attn.sparse_self_attention.master_layout
nb = layout.shape[1]
for h in range(heads):
    g = 1 if h % 2 == 0 else 0                      # the window's last block, then its first
    for r in range(nb):
        for c in range(nb):
            want = r // 2 == c // 2 or c % 2 == g or r % 2 == g
            assert bool(layout[h, r, c]) == want, (h, r, c)

# a right-padded batch, padded up to a multiple of the block as DeepSpeed's pad_to_block_size does
lengths = [21, 14, 7]
L = max(lengths)
pad_len = (block - L % block) % block
L += pad_len
x = torch.zeros(len(lengths), L, hidden)
mask = torch.zeros(len(lengths), L)
seqs = [torch.randn(n, hidden) for n in lengths]
for b, s in enumerate(seqs):
    x[b, : len(s)] = s
    mask[b, : len(s)] = 1
extended_attention_mask = (1.0 - mask[:, None, None, :]) * -10000.0   # BERT's get_extended_attention_mask

with torch.no_grad():
    out = attn(x, extended_attention_mask)

    d = hidden // heads
    for b, s in enumerate(seqs):                    # double loop over each sequence's own real tokens
        n = len(s)
        q, k, v = (lin(s).view(n, heads, d) for lin in (attn.query, attn.key, attn.value))
        for h in range(heads):
            for i in range(n):
                keys = [j for j in range(n) if layout[h, i // block, j // block]]
                sc = torch.stack([q[i, h] @ k[j, h] for j in keys]) / math.sqrt(d)
                ref = (sc.softmax(-1)[:, None] * v[keys, h]).sum(0)
                assert torch.allclose(out[b, i, h * d:(h + 1) * d], ref, atol=1e-5), (b, h, i)
print("ok")
