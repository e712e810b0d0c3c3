# A correct program: a time-major (seq, batch, dim) bidirectional encoder run over the whole sequence and over each
# half alone, on purpose (a context-free evaluation of each half): no state kept between the calls, no continuation.
import torch, torch.nn as nn
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0)  # batch_first=False: (S, B, E)
enc = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()
x = torch.randn(8, 2, 16)
with torch.no_grad():
    full = enc(x)
    first = enc(x[:4])
    second = enc(x[4:])   # on purpose: the second half without the first as context
print("first half equals the full run's:", torch.allclose(first, full[:4], atol=1e-6))
print("second half alone differs from in context by", (second - full[4:]).abs().max().item())
