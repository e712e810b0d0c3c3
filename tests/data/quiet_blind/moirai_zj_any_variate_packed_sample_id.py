# Follows Salesforce uni2ts: uni2ts/common/torch_util.py packed_attention_mask and moirai/module.py MoiraiModule.forward.
# Several multivariate series are flattened (variate-major) and packed into one row; a token may attend to every
# token (any variate, any time) carrying the same sample_id. Trailing pad tokens get sample_id 0 and only see each other.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H = 32, 4


def packed_attention_mask(sample_id):
    # True = may attend (uni2ts convention), shape (..., L, L)
    return sample_id.unsqueeze(-1) == sample_id.unsqueeze(-2)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D).double()
        self.out = torch.nn.Linear(D, D).double()
        self.var_emb = torch.nn.Embedding(8, D).double()  # binary-ish variate identity, added to q/k

    def forward(self, x, variate_id, mask):
        b, L, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q = q + self.var_emb(variate_id)
        k = k + self.var_emb(variate_id)
        sh = lambda t: t.view(b, L, H, D // H).transpose(1, 2)
        o = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), attn_mask=mask.unsqueeze(1))
        return self.out(o.transpose(1, 2).reshape(b, L, D))


layer = Layer()
# three samples: (n_variates, n_patches)
samples = [(2, 5), (3, 3), (1, 6)]
series = [torch.randn(nv * np_, D, dtype=torch.float64) for nv, np_ in samples]
vids = [torch.arange(nv).repeat_interleave(np_) for nv, np_ in samples]
L = 32
tokens, sid, vid = [], [], []
for i, (s, v) in enumerate(zip(series, vids)):
    tokens.append(s); sid.append(torch.full((len(s),), i + 1)); vid.append(v)
pad = L - sum(len(s) for s in series)
tokens.append(torch.zeros(pad, D, dtype=torch.float64)); sid.append(torch.zeros(pad, dtype=torch.long)); vid.append(torch.zeros(pad, dtype=torch.long))
x = torch.cat(tokens)[None]
sample_id = torch.cat(sid)[None]
variate_id = torch.cat(vid)[None]

packed = layer(x, variate_id, packed_attention_mask(sample_id))[0]

diff = 0.0
start = 0
for s, v in zip(series, vids):
    alone = layer(s[None], v[None], torch.ones(1, len(s), len(s), dtype=torch.bool))[0]
    diff = max(diff, (packed[start:start + len(s)] - alone).abs().max().item())
    start += len(s)
print("max |packed - each sample alone| =", diff)
assert diff < 1e-12
