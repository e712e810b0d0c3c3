"""nn.TransformerEncoder inference fast path: padded positions come back as exact zeros, on purpose.

Follows pytorch/pytorch torch/nn/modules/transformer.py (TransformerEncoder.forward with
enable_nested_tensor=True: src_key_padding_mask turns the batch into a nested tensor, the layers run
TransformerEncoderLayer's fused fast path, and to_padded_tensor(0., src.size()) fills the padded positions
with 0) as used e.g. by the PyTorch "Fast Transformer Inference with Better Transformer" tutorial.  The model
is in eval mode under inference_mode, batch_first=True, so the fast path applies.

src_key_padding_mask (True = padding) is the program's statement of which tokens exist.  The padded rows of
the output are not attention outputs at all; a checker must not read them as queries that attended to
nothing.  Reference: each sequence alone, unpadded, through the same encoder's weights applied layer by layer by hand
(post-norm: norm1(x + self_attn(x)), norm2(h + ffn(h)); eval, so dropout is off; no mask at all).  Real rows must agree to float32 rounding; padded rows must be exactly 0.  The same encoder is also run
on its slow path (autograd on), where the padded rows are ordinary garbage rows; real rows must agree.
"""
import warnings
import torch

warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")

torch.manual_seed(0)
E, H, L = 32, 4, 2
layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.1, batch_first=True)
enc = torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=True).eval()

lengths = [7, 3, 5, 1]
T = max(lengths)
src = torch.randn(len(lengths), T, E)
pad = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
src = src.masked_fill(pad[..., None], 1e3)  # junk in the padded slots

with torch.inference_mode():
    out = enc(src, src_key_padding_mask=pad)
    max_diff = 0.0
    for b, n in enumerate(lengths):
        # reference: one sequence, no padding, no mask, no fast path
        ref = src[b:b + 1, :n]
        for mod in enc.layers:
            h = mod.norm1(ref + mod.self_attn(ref, ref, ref, need_weights=False)[0])
            ref = mod.norm2(h + mod.linear2(mod.activation(mod.linear1(h))))
        max_diff = max(max_diff, (out[b, :n] - ref[0]).abs().max().item())
    pad_abs = out[pad].abs().max().item()

# the same module on its slow path (autograd on: no nested tensor, no fused kernel): key_padding_mask is applied
# inside MultiheadAttention and the padded query rows come back as garbage attention outputs, not zeros.
# Both paths mean the same thing: only the real rows are results.
with torch.enable_grad():
    slow = enc(src.clone().requires_grad_(True), src_key_padding_mask=pad).detach()
slow_diff = (slow[~pad] - out[~pad]).abs().max().item()
slow_pad_rows = slow[pad].abs().max().item()

print("output is nested-to-padded:", tuple(out.shape), "padded rows max |.|:", pad_abs)
print("max |fast path batch - per-sequence manual layers|:", max_diff)
print("max |fast - slow path| on real rows:", slow_diff, " slow path padded rows max |.| (garbage):", slow_pad_rows)
assert pad_abs == 0.0 and max_diff < 1e-4 and slow_diff < 1e-4
