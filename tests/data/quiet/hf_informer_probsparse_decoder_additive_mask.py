# Follows transformers' models/informer/modeling_informer.py InformerProbSparseAttention, written without transformers:
# heads folded into the batch (bsz * heads, L, d), the top-u queries by the sparsity measurement
# `max(QK_sample) - sum(QK_sample) / L_K` gathered per (row, head) with `query_states[dim_for_slice, M_top]`, the 4-D
# additive causal mask (finfo.min above the diagonal, as _prepare_4d_causal_attention_mask makes it) expanded over the
# heads and gathered at the same queries (`prob_mask[dim_for_slice, M_top, :]`), and the lazy queries given
# `value_states.cumsum(dim=-2)` (is_decoder). Each head attends its own u queries, causally; the rest never attend.
# One departure: the softmax is taken on the (bsz, heads, u, src_len) view the mask was added in, then folded back.
# Checked against a loop over rows, heads and queries: a causal softmax for each selected query, the running sum of
# the values for every other one.
import math

import numpy as np
import torch

torch.manual_seed(1)
torch.set_default_dtype(torch.float64)

bsz, num_heads, tgt_len, head_dim, sampling_factor = 3, 4, 12, 8, 2
query_states = torch.randn(bsz * num_heads, tgt_len, head_dim)
key_states = torch.randn(bsz * num_heads, tgt_len, head_dim)
value_states = torch.randn(bsz * num_heads, tgt_len, head_dim)
src_len = key_states.size(1)
causal = torch.full((tgt_len, src_len), torch.finfo(torch.float64).min).triu(1)
attention_mask = causal[None, None].expand(bsz, 1, tgt_len, src_len)

log_key_length = np.ceil(np.log1p(src_len)).astype("int").item()
log_query_length = np.ceil(np.log1p(tgt_len)).astype("int").item()
u_part = min(sampling_factor * tgt_len * log_key_length, src_len)
u = min(sampling_factor * log_query_length, tgt_len)

index_sample = torch.randint(0, src_len, (u_part,))
k_sample = key_states[:, index_sample, :]
queries_keys_sample = torch.bmm(query_states, k_sample.transpose(1, 2))
sparsity_measurement = queries_keys_sample.max(dim=-1)[0] - torch.div(queries_keys_sample.sum(dim=-1), src_len)
top_u_sparsity_measurement = sparsity_measurement.topk(u, sorted=False)[1]
dim_for_slice = torch.arange(query_states.size(0)).unsqueeze(-1)
q_reduce = query_states[dim_for_slice, top_u_sparsity_measurement]

attn_weights = torch.bmm(q_reduce, key_states.transpose(1, 2)) / math.sqrt(head_dim)
prob_mask = attention_mask.expand(bsz, num_heads, tgt_len, src_len).reshape(bsz * num_heads, tgt_len, src_len)
prob_mask = prob_mask[dim_for_slice, top_u_sparsity_measurement, :]
attn_weights = attn_weights.view(bsz, num_heads, u, src_len) + prob_mask.view(bsz, num_heads, u, src_len)
attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1).view(bsz * num_heads, u, src_len)
attn_output = torch.bmm(attn_weights, value_states)
context = value_states.cumsum(dim=-2)
context[dim_for_slice, top_u_sparsity_measurement] = attn_output

ref = torch.zeros_like(context)
for n in range(bsz * num_heads):
    chosen = set(top_u_sparsity_measurement[n].tolist())
    for i in range(tgt_len):
        if i in chosen:
            s = key_states[n, : i + 1] @ query_states[n, i] / math.sqrt(head_dim)
            ref[n, i] = torch.softmax(s, 0) @ value_states[n, : i + 1]
        else:
            ref[n, i] = value_states[n, : i + 1].sum(0)
diff = (context - ref).abs().max().item()
print(f"selected queries per head: {u} of {tgt_len}; max abs diff: {diff:.3e}")
assert diff < 1e-12
