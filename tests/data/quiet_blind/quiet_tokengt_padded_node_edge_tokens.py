# Correct program. Ported from jw9730/tokengt large-scale-regression/tokengt/modules/tokenizer.py
# (get_batch: node and edge tokens of each graph packed left, padded_mask from node_num + edge_num, graph token
# prepended; encoder layers get self_attn_padding_mask).
import torch
torch.manual_seed(0)
D, H = 16, 2
node_num, edge_num = [3, 2], [2, 1]
seq_len = [n + e for n, e in zip(node_num, edge_num)]
max_len = max(seq_len)
toks = [torch.randn(s, D) for s in seq_len]
padded = torch.zeros(2, max_len, D)
for b, t in enumerate(toks): padded[b, :len(t)] = t
padded_mask = torch.arange(max_len)[None] >= torch.tensor(seq_len)[:, None]
graph_token = torch.randn(1, 1, D)
x = torch.cat([graph_token.expand(2, 1, D), padded], 1)
mask = torch.cat([torch.zeros(2, 1, dtype=torch.bool), padded_mask], 1)
layer = torch.nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True).eval()
y = layer(x, src_key_padding_mask=mask)
for b in range(2):
    xb = torch.cat([graph_token, toks[b][None]], 1)
    assert torch.allclose(y[b, 0], layer(xb)[0, 0], atol=1e-5)   # graph readout
print("ok")
