# Follows lifeiteng/vall-e valle/models/valle.py, VALLE.forward (AR stage): x_attn_mask lets text see all text
# but no audio; y_attn_mask is causal over audio and sees all text; both are True = masked, OR-ed with the
# key padding mask of [text | audio] (padding sits in the MIDDLE of the row), then turned into a -inf float mask.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dt = torch.float64
D, Hh = 32, 4
layer = torch.nn.TransformerEncoderLayer(D, Hh, 64, dropout=0.0, batch_first=True, dtype=dt).eval()
x_lens = torch.tensor([5, 3])
y_lens = torch.tensor([6, 9])
B = 2
x_len, y_len = int(x_lens.max()), int(y_lens.max())
x = torch.randn(B, x_len, D, dtype=dt)
y = torch.randn(B, y_len, D, dtype=dt)


def make_pad_mask(lengths, max_len):
    return torch.arange(max_len)[None, :] >= lengths[:, None]          # True = pad


def ar_forward(x, y, x_lens, y_lens):
    B, x_len, _ = x.shape
    y_len = y.shape[1]
    x_mask = make_pad_mask(x_lens, x_len)
    y_mask = make_pad_mask(y_lens, y_len)
    xy_padding_mask = torch.concat([x_mask, y_mask], dim=1)
    x_attn_mask = F.pad(torch.zeros((x_len, x_len), dtype=torch.bool), (0, y_len), value=True)
    y_attn_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)
    xy_attn_mask = torch.concat([x_attn_mask, y_attn_mask], dim=0)
    _xy_padding_mask = (xy_padding_mask.view(B, 1, 1, x_len + y_len).expand(-1, Hh, -1, -1)
                        .reshape(B * Hh, 1, x_len + y_len))
    xy_attn_mask = xy_attn_mask.logical_or(_xy_padding_mask)
    new_attn_mask = torch.zeros_like(xy_attn_mask, dtype=dt)
    new_attn_mask.masked_fill_(xy_attn_mask, float("-inf"))
    xy = torch.concat([x, y], dim=1)
    return layer(xy, src_mask=new_attn_mask)


with torch.no_grad():
    out = ar_forward(x, y, x_lens, y_lens)
    diff = 0.0
    for b in range(B):
        xl, yl = int(x_lens[b]), int(y_lens[b])
        xy = torch.cat([x[b, :xl], y[b, :yl]])[None]
        # reference: explicit per-query loop, no padding, one query row at a time
        for i in range(xl + yl):
            keys = list(range(xl)) if i < xl else list(range(i + 1))
            m = torch.full((1, xl + yl), float("-inf"), dtype=dt)
            m[:, keys] = 0.0
            # only row i matters; run the layer on the full unpadded sequence with that row's mask
            full_m = m.expand(xl + yl, xl + yl).contiguous()
            r = layer(xy, src_mask=full_m)[0, i]
            got = out[b, i] if i < xl else out[b, x_len + (i - xl)]
            diff = max(diff, (got - r).abs().max().item())
print("max |padded AR prefix-LM mask - per-query unpadded| =", diff)
assert diff < 1e-12
