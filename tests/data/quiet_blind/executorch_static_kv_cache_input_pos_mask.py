# Follows pytorch/executorch examples/models/llama/llama_transformer.py + attention.py (KVCache.update, mask[input_pos]):
# a (max_seq, max_seq) causal float mask buffer (0 keep / -inf) is sliced by input_pos; keys live in a fixed-size
# cache written with index_put at input_pos, so rows also see zero-filled future cache slots that the mask hides.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, max_seq = 32, 16
Wq, Wk, Wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
mask_buf = torch.zeros(max_seq, max_seq).masked_fill(~causal, float("-inf"))
k_cache = torch.zeros(1, max_seq, D); v_cache = torch.zeros(1, max_seq, D)

def step(x, input_pos):
    q, k, v = x @ Wq, x @ Wk, x @ Wv
    k_cache[:, input_pos] = k; v_cache[:, input_pos] = v      # index_put_
    mask = mask_buf[input_pos]                                # (seqlen, max_seq)
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)

seq = torch.randn(1, 11, D)
outs = [step(seq[:, :5], torch.arange(5))]                   # prefill 5
for p in range(5, 11):                                        # decode one at a time
    outs.append(step(seq[:, p:p + 1], torch.tensor([p])))
out = torch.cat(outs, 1)
ref = torch.nn.functional.scaled_dot_product_attention(seq @ Wq, seq @ Wk, seq @ Wv, is_causal=True)
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
