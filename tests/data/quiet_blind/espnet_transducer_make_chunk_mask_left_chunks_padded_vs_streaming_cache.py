# ESPnet2 (espnet2/asr_transducer/utils.py make_chunk_mask / make_source_mask; encoder/encoder.py Encoder.forward):
# make_chunk_mask returns True = masked: frame i sees its own chunk plus num_left_chunks previous chunks; it is OR-ed
# with the padding mask (True = pad). Checked against chunk-by-chunk streaming with a left-context K/V cache per layer.
import torch
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, CHUNK, LEFT, NL = 32, 4, 4, 2, 2

def make_chunk_mask(size, chunk_size, num_left_chunks=0):
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        start = 0 if num_left_chunks <= 0 else max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        end = min((i // chunk_size + 1) * chunk_size, size)
        mask[i, start:end] = True
    return ~mask

def make_source_mask(lengths):
    return torch.arange(int(lengths.max()))[None, :] >= lengths[:, None]  # True = padding

layers = [dict(qkv=torch.nn.Linear(D, 3 * D), o=torch.nn.Linear(D, D), ff=torch.nn.Linear(D, D)) for _ in range(NL)]

def attn(l, xq, xkv, masked):
    q = l["qkv"](xq)[..., :D]; k, v = l["qkv"](xkv)[..., D:].split(D, -1)
    sp = lambda t: t.view(t.shape[0], t.shape[1], H, D // H).transpose(1, 2)
    s = sp(q) @ sp(k).transpose(-1, -2) / (D // H) ** 0.5
    s = s.masked_fill(masked, float("-inf"))
    y = (s.softmax(-1) @ sp(v)).transpose(1, 2).reshape(xq.shape)
    h = xq + l["o"](y)
    return h + torch.tanh(l["ff"](h))

with torch.no_grad():
    lengths = torch.tensor([15, 9])  # utterance 2 ends mid-chunk, its tail is padding
    x = torch.randn(2, 15, D)
    chunk_mask = make_chunk_mask(15, CHUNK, LEFT)
    masked = (chunk_mask[None] | make_source_mask(lengths)[:, None, :])[:, None]  # (B,1,T,T)
    h = x
    for l in layers:
        h = attn(l, h, h, masked)
    diff = 0.0
    for b in range(2):
        T = int(lengths[b]); xs = x[b:b + 1, :T]
        caches = [torch.zeros(1, 0, D) for _ in layers]; outs = []
        for s0 in range(0, T, CHUNK):
            c = xs[:, s0:s0 + CHUNK]
            for li, l in enumerate(layers):
                kv = torch.cat([caches[li], c], 1)
                caches[li] = kv[:, -LEFT * CHUNK:] if kv.shape[1] > LEFT * CHUNK else kv
                c = attn(l, c, kv, torch.zeros(1, 1, c.shape[1], kv.shape[1], dtype=torch.bool))
            outs.append(c)
        ref = torch.cat(outs, 1)[0]
        diff = max(diff, (h[b, :T] - ref).abs().max().item())
    print("max diff chunk mask (left chunks) + padding vs streaming with left cache:", diff)
    assert diff < 1e-10
