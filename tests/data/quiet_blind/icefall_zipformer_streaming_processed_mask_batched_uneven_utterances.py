"""icefall Zipformer streaming decode: a batch of utterances of uneven length, a fixed-size left-context cache
that starts empty, and processed_mask hiding the cache slots no frame has filled yet.

Follows k2-fsa/icefall egs/librispeech/ASR/zipformer/streaming_decode.py, streaming_forward:
      src_key_padding_mask = make_pad_mask(x_lens)
      # processed_mask is used to mask out initial states
      processed_mask = torch.arange(left_context_len).expand(x.size(0), left_context_len)
      processed_lens = states[-1]  # (batch,)
      processed_mask = (processed_lens.unsqueeze(1) <= processed_mask).flip(1)
      new_processed_lens = processed_lens + x_lens
      src_key_padding_mask = torch.cat([processed_mask, src_key_padding_mask], dim=1)
  and the training-time simulation in zipformer/zipformer.py Zipformer2._get_attn_mask:
      c = t // chunk_size; src_c = c; tgt_c = c.unsqueeze(-1)
      attn_mask = torch.logical_or(src_c > tgt_c, src_c < tgt_c - left_context_chunks)
  (True = masked in both). Each layer keeps its last left_context_len keys/values as cached state.
Reduced: no subsampling / convolution / bypass, plain scaled dot product attention, 2 layers, float64.
Check: every valid frame of the batched streaming run equals the utterance run alone, unpadded, through the
full forward with the chunk mask of _get_attn_mask.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

D, H, LAYERS = 16, 2, 2
CHUNK, LEFT_CHUNKS = 4, 2
LEFT_CONTEXT_LEN = CHUNK * LEFT_CHUNKS


def make_pad_mask(lengths, max_len):
    return torch.arange(max_len).expand(lengths.size(0), max_len) >= lengths.unsqueeze(1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D))
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, k_extra=None, v_extra=None, attn_mask=None, key_padding_mask=None):
        # x: (N, T, D). Returns output and this chunk's (k, v) for caching.
        N, T, _ = x.shape
        y = self.n1(x)
        split = lambda t: t.view(N, -1, H, D // H).transpose(1, 2)
        q, k, v = split(self.q(y)), split(self.k(y)), split(self.v(y))
        k_all = k if k_extra is None else torch.cat([k_extra, k], 2)
        v_all = v if v_extra is None else torch.cat([v_extra, v], 2)
        s = q @ k_all.transpose(-1, -2) / (D // H) ** 0.5
        if attn_mask is not None:
            s = s.masked_fill(attn_mask, float("-inf"))
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        x = x + self.o((s.softmax(-1) @ v_all).transpose(1, 2).reshape(N, T, D))
        return x + self.ff(self.n2(x)), k, v


layers = nn.ModuleList(Layer() for _ in range(LAYERS)).eval()
lengths = torch.tensor([19, 10, 5])
T = int(lengths.max())
feats = torch.randn(len(lengths), T, D)

with torch.no_grad():
    # batched streaming decode
    N = len(lengths)
    cached_k = [torch.zeros(N, H, LEFT_CONTEXT_LEN, D // H) for _ in range(LAYERS)]
    cached_v = [torch.zeros(N, H, LEFT_CONTEXT_LEN, D // H) for _ in range(LAYERS)]
    processed_lens = torch.zeros(N, dtype=torch.long)
    outs = []
    for start in range(0, T, CHUNK):
        x = feats[:, start:start + CHUNK]
        x_lens = (lengths - start).clamp(0, x.size(1))
        src_key_padding_mask = make_pad_mask(x_lens, x.size(1))
        processed_mask = torch.arange(LEFT_CONTEXT_LEN).expand(N, LEFT_CONTEXT_LEN)
        processed_mask = (processed_lens.unsqueeze(1) <= processed_mask).flip(1)
        processed_lens = processed_lens + x_lens
        src_key_padding_mask = torch.cat([processed_mask, src_key_padding_mask], dim=1)
        for i, layer in enumerate(layers):
            x, k, v = layer(x, cached_k[i], cached_v[i], key_padding_mask=src_key_padding_mask)
            cached_k[i] = torch.cat([cached_k[i], k], 2)[:, :, -LEFT_CONTEXT_LEN:]
            cached_v[i] = torch.cat([cached_v[i], v], 2)[:, :, -LEFT_CONTEXT_LEN:]
        outs.append(x)
    streamed = torch.cat(outs, 1)

    worst = 0.0
    for b, n in enumerate(lengths.tolist()):
        t = torch.arange(n)
        c = t // CHUNK
        src_c, tgt_c = c, c.unsqueeze(-1)
        attn_mask = torch.logical_or(src_c > tgt_c, src_c < tgt_c - LEFT_CHUNKS)
        y = feats[b:b + 1, :n]
        for layer in layers:
            y, _, _ = layer(y, attn_mask=attn_mask)
        worst = max(worst, (streamed[b, :n] - y[0]).abs().max().item())
print(f"max |batched streaming with processed_mask - utterance alone with chunk mask|: {worst:.3e}")
assert worst < 1e-10
