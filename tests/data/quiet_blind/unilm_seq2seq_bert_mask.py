# Follows microsoft/unilm unilm-v1 src/biunilm/seq2seq_loader.py (Preprocess4Seq2seq.__call__): input_mask[:, :len_a+2]=1,
# target block gets _tril_matrix; pad rows still see the source; BERT-style (1-mask)*-10000 additive bias.
import torch
torch.manual_seed(0)
D, max_len = 16, 16
def seq2seq_mask(len_a, len_b, max_len):
    tril = torch.tril(torch.ones(max_len, max_len, dtype=torch.long))
    input_mask = torch.zeros(max_len, max_len, dtype=torch.long)
    input_mask[:, :len_a + 2].fill_(1)
    st, end = len_a + 2, len_a + len_b + 3
    input_mask[st:end, st:end].copy_(tril[:end - st, :end - st])
    return input_mask
shapes = [(4, 5), (2, 3)]
mask = torch.stack([seq2seq_mask(a, b, max_len) for a, b in shapes]).double()
x = torch.randn(2, max_len, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / 4 for _ in range(3))
s = (x @ Wq) @ (x @ Wk).transpose(1, 2) / D ** 0.5 + (1.0 - mask) * -10000.0
out = torch.softmax(s, -1) @ (x @ Wv)
diff = 0.0
for bi, (a, b) in enumerate(shapes):
    n, src = a + b + 3, a + 2
    for i in range(n):
        js = list(range(src)) + ([j for j in range(src, n) if j <= i] if i >= src else [])
        r = torch.softmax((x[bi, js] @ Wk) @ (x[bi, i] @ Wq) / D ** 0.5, 0) @ (x[bi, js] @ Wv)
        diff = max(diff, (r - out[bi, i]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
