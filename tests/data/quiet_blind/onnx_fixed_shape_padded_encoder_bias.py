# Follows huggingface/optimum-style fixed-shape ONNX export of an encoder (inputs padded to a static length)
# with transformers' modeling_utils get_extended_attention_mask: (1 - mask) * finfo.min as an additive bias;
# the graph only ever sees the static shape; padded output rows are discarded by masked mean pooling.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, STATIC = 32, 16
layer = torch.nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True).eval()

class Fixed(torch.nn.Module):
    def forward(self, x, attention_mask):
        ext = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(x.dtype).min   # float bias, 0 = keep
        ext = ext.expand(-1, 4, STATIC, -1).reshape(-1, STATIC, STATIC)
        h = layer(x, src_mask=ext)
        m = attention_mask[..., None]
        return (h * m).sum(1) / m.sum(1)                       # masked mean pool drops padded rows

with torch.no_grad():
    g = Fixed()
    lens = [16, 5]
    seqs = [torch.randn(n, D) for n in lens]
    x = torch.zeros(2, STATIC, D); am = torch.zeros(2, STATIC)
    for b, s in enumerate(seqs):
        x[b, : len(s)] = s; am[b, : len(s)] = 1
    out = g(x, am)
    diff = max((out[b] - layer(s[None]).mean(1)[0]).abs().max().item() for b, s in enumerate(seqs))
print("max diff", diff)
assert diff < 1e-9
