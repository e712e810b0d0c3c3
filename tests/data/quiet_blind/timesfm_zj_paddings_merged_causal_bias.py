# Follows google-research/timesfm src/timesfm/pytorch_patched_decoder.py: convert_paddings_to_mask, causal_mask,
# merge_masks (float biases, min over both). paddings: 1.0 = padded patch; short contexts are padded on the LEFT, so
# leading pad queries see nothing under the causal bias (uniform-softmax rows that are discarded afterwards).
import torch

torch.manual_seed(0)
D, H, P = 32, 4, 4  # model dim, heads, patch length
NEG = torch.finfo(torch.float64).min


def convert_paddings_to_mask(paddings, dtype):
    return (paddings.to(dtype) * NEG)[:, None, None, :]


def causal_mask(x):
    L = x.shape[1]
    return (torch.triu(torch.ones(L, L, dtype=x.dtype), diagonal=1) * NEG)[None, None]


def merge_masks(a, b):
    return torch.minimum(a, b)


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(2 * P, D).double()  # patch values + patch padding flags, as in TimesFM
        self.qkv = torch.nn.Linear(D, 3 * D).double()
        self.o = torch.nn.Linear(D, D).double()
        self.head = torch.nn.Linear(D, P).double()

    def forward(self, patches, patch_pads, paddings):
        x = self.inp(torch.cat([patches * (1 - patch_pads), patch_pads], -1))
        b, L, _ = x.shape
        bias = merge_masks(convert_paddings_to_mask(paddings, x.dtype), causal_mask(x))
        q, k, v = [t.view(b, L, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)]
        s = q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias
        a = torch.softmax(s, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, L, D))
        return self.head(x)


dec = Decoder()
lengths = [32, 20, 12]  # raw context lengths (multiples of P)
N = 32
ctx = [torch.randn(n, dtype=torch.float64) for n in lengths]
vals = torch.zeros(len(ctx), N, dtype=torch.float64)
pads = torch.ones(len(ctx), N, dtype=torch.float64)
for i, c in enumerate(ctx):
    vals[i, N - len(c):] = c
    pads[i, N - len(c):] = 0.0
patches = vals.view(len(ctx), N // P, P)
patch_pads = pads.view(len(ctx), N // P, P)
paddings = patch_pads[..., -1]  # a patch counts as padded by its last step (all steps here)
out = dec(patches, patch_pads, paddings)

diff = 0.0
for i, c in enumerate(ctx):
    n = len(c) // P
    alone = dec(c.view(1, n, P), torch.zeros(1, n, P, dtype=torch.float64), torch.zeros(1, n, dtype=torch.float64))[0]
    diff = max(diff, (out[i, -n:] - alone).abs().max().item())
print("max |left-padded batch - each series alone| =", diff)
assert diff < 1e-12
