# Follows salesforce/LAVIS lavis/models/blip2_models/Qformer.py (BertModel.get_extended_attention_mask, has_query)
# and blip2_qformer.py ITG loss: queries attend only to queries (bidirectional), text attends to all queries
# + causal text; right-padded text keys are removed by the 0/1 padding mask, then (1 - mask) * -10000.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
B, Q, T, D = 2, 4, 7, 32
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
query = torch.randn(1, Q, D).expand(B, Q, D)
text = torch.randn(B, T, D)
text_att = torch.ones(B, T); text_att[1, 4:] = 0          # right padding
query_atts = torch.ones(B, Q)
attention_mask = torch.cat([query_atts, text_att], 1)

def extended_mask(attention_mask, input_shape, has_query):
    batch_size, seq_length = input_shape
    seq_ids = torch.arange(seq_length)
    causal_mask = (seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]).to(attention_mask.dtype)
    if causal_mask.shape[1] < attention_mask.shape[1]:
        prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
        if has_query:  # UniLM style: query rows see no text
            causal_mask = torch.cat([torch.zeros((batch_size, prefix_seq_len, seq_length), dtype=causal_mask.dtype), causal_mask], 1)
        causal_mask = torch.cat([torch.ones((batch_size, causal_mask.shape[1], prefix_seq_len), dtype=causal_mask.dtype), causal_mask], -1)
    ext = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
    return (1.0 - ext) * -10000.0

ext = extended_mask(attention_mask, (B, T), has_query=True)[:, 0]
h = torch.cat([query, text], 1)
s = (h @ Wq) @ (h @ Wk).transpose(1, 2) / D ** 0.5 + ext
out = s.softmax(-1) @ (h @ Wv)

diff = 0.0
for b in range(B):
    n = int(text_att[b].sum())
    for i in range(Q + n):   # padded text rows are discarded (loss uses labels -100 there)
        keys = list(range(Q)) if i < Q else list(range(i + 1))
        hk = h[b, keys]
        ref = ((h[b, i] @ Wq) @ (hk @ Wk).T / D ** 0.5).softmax(0) @ (hk @ Wv)
        diff = max(diff, (out[b, i] - ref).abs().max().item())
print("max diff", diff)
assert diff < 1e-9
