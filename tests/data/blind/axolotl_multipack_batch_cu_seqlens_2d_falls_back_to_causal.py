# axolotl-ai-cloud/axolotl#1375: with sample packing and micro_batch_size > 1, get_cu_seqlens_from_pos_ids
# returns a 2-D cu_seqlens, the `cu_seqlens.dim() == 1` test in the llama flash-attn hijack fails, and the
# packed row is attended as one causal sequence: each packed example sees the examples packed before it.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# CPU stand-ins for the flash_attn kernels the hijack calls (same signatures, (total, 3, h, d) packed qkv)
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False):
    total = qkv.shape[0]
    seq_idx = torch.bucketize(torch.arange(total), cu_seqlens[1:], right=True)
    mask = seq_idx[:, None] == seq_idx[None, :]
    if causal:
        mask = mask & torch.ones(total, total, dtype=torch.bool).tril()
    q, k, v = qkv.unbind(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def get_cu_seqlens_from_pos_ids(position_ids):
    """generate a cumulative sequence length mask for flash attention using pos ids"""
    if len(position_ids.shape) == 1:
        position_ids = position_ids.unsqueeze(0)
    results, max_seq_lens = [], []
    for row in position_ids:
        # Count the number of consecutive zeros from the right side
        padding_length = (row == 0).int().flip(dims=[0]).cumprod(dim=0).sum().item()
        adjusted_row = row[:-padding_length] if padding_length else row.clone()
        # Find where the position resets to 0 (indicating a new sequence)
        seq_starts = torch.cat([torch.tensor([True]), adjusted_row[1:] == 0])
        start_indices = torch.cat([torch.nonzero(seq_starts).unbind(dim=1)[0], torch.tensor([len(adjusted_row)])])
        seq_lengths = start_indices[1:] - start_indices[:-1]
        cu_seqlens = torch.cat([torch.tensor([0]), seq_lengths.cumsum(0)]).to(torch.int32)
        if padding_length:
            cu_seqlens = torch.cat([cu_seqlens, torch.tensor([len(row)], dtype=torch.int32)])
        results.append(cu_seqlens)
        max_seq_lens.append((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    max_value = max(t.max() for t in results)
    max_length = max(t.size(0) for t in results)
    padded_results = [F.pad(t, (0, max_length - t.size(0)), "constant", max_value) for t in results]
    return torch.stack(padded_results).to(dtype=torch.int32), torch.stack(max_seq_lens)


def flatten_cu_seqlens(cu_seqlens, seq_length):
    # one cumulative-length vector over the (b s) token axis, as the varlen kernel expects
    rows = [torch.unique_consecutive(r) + i * seq_length for i, r in enumerate(cu_seqlens)]
    return torch.unique_consecutive(torch.cat(rows)).to(torch.int32)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def flashattn_forward(self, hidden_states, cu_seqlens=None, max_seqlen=None):
        bsz, q_len, _ = hidden_states.size()
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query_states = self.q_proj(hidden_states).view(shape)
        key_states = self.k_proj(hidden_states).view(shape)
        value_states = self.v_proj(hidden_states).view(shape)
        if cu_seqlens is not None and max_seqlen is not None and cu_seqlens.dim() == 1:
            # special handling using sample packing
            qkv = torch.stack([query_states, key_states, value_states], dim=2)
            qkv = qkv.reshape(bsz * q_len, 3, self.num_heads, self.head_dim)
            output = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, 0.0, softmax_scale=None, causal=True)
            output = output.reshape(bsz, q_len, self.num_heads, self.head_dim)
        else:
            output = flash_attn_func(query_states, key_states, value_states, 0.0, softmax_scale=None, causal=True)
        return self.o_proj(output.reshape(bsz, q_len, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size=32):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 64), nn.SiLU(), nn.Linear(64, hidden_size))

    def forward(self, hidden_states, cu_seqlens, max_seqlen):
        h = hidden_states + self.self_attn.flashattn_forward(self.input_layernorm(hidden_states), cu_seqlens, max_seqlen)
        return h + self.mlp(h)


class TinyLlama(nn.Module):
    def __init__(self, vocab=50, hidden_size=32, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden_size)
        self.pos = nn.Embedding(64, hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden_size) for _ in range(n_layers))
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(self, input_ids, position_ids):
        h = self.embed_tokens(input_ids) + self.pos(position_ids)
        seq_length = input_ids.shape[1]
        position_ids = position_ids.view(-1, seq_length).long()
        cu_seqlens, max_seqlen = get_cu_seqlens_from_pos_ids(position_ids)
        cu_seqlens = cu_seqlens.squeeze()
        if FIXED and cu_seqlens.dim() > 1:
            cu_seqlens, max_seqlen = flatten_cu_seqlens(cu_seqlens, seq_length), max_seqlen.max()
        for layer in self.layers:
            h = layer(h, cu_seqlens, max_seqlen)
        return self.lm_head(h)


model = TinyLlama().eval()
# multipack collator: micro_batch_size=2, each row packs several examples, position_ids restart at 0
examples = [[torch.randint(1, 50, (n,)) for n in lens] for lens in ([5, 4, 3], [6, 6])]
input_ids = torch.stack([torch.cat(row) for row in examples])
position_ids = torch.stack([torch.cat([torch.arange(len(e)) for e in row]) for row in examples])

with torch.no_grad():
    logits = model(input_ids, position_ids)
    # reference: the second example of row 0, run on its own
    alone = model(examples[0][1][None], torch.arange(4)[None])
diff = (logits[0, 5:9] - alone[0]).abs().max().item()
print(f"fixed={FIXED} max |packed - alone| logits of example 2 in row 0: {diff:.4f}")
