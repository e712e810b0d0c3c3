"""WeNet streaming decoding: forward_chunk_by_chunk with a truncated attention cache equals the full forward
with the decoding chunk mask.

Follows wenet-e2e/wenet, wenet/transformer/encoder.py:
  BaseEncoder.forward -> add_optional_chunk_mask(xs, masks, use_dynamic_chunk, ..., decoding_chunk_size,
      static_chunk_size, num_decoding_left_chunks) -> subsequent_chunk_mask(size, chunk_size, num_left_chunks)
  BaseEncoder.forward_chunk_by_chunk(xs, decoding_chunk_size, num_decoding_left_chunks):
      required_cache_size = decoding_chunk_size * num_decoding_left_chunks
  BaseEncoder.forward_chunk: att_cache per layer is (k, v) concatenated in front of the new chunk's keys,
      the chunk attends to all of it (att_mask is all ones: torch.ones((0,0,0)) in streaming), and
      next_cache_start = max(attention_key_size - required_cache_size, 0) keeps the last cached frames.
Reduced: no subsampling / conv module / rel-pos, 2 layers, float64, one utterance (streaming decodes batch 1).
Check: the chunk-by-chunk outputs equal the masked full-utterance forward frame by frame.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

D, H, LAYERS = 16, 4, 2
DECODING_CHUNK, LEFT_CHUNKS = 4, 2


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1):  # wenet/utils/mask.py
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, mask, att_cache):
        # x: (1, t, D); mask: (1, t, T_cache + t) bool, True = attend (wenet convention); att_cache: (1, H, T_cache, 2*d_k)
        b, t, _ = x.shape
        y = self.n1(x)
        q = self.q(y).view(b, t, H, D // H).transpose(1, 2)
        k = self.k(y).view(b, t, H, D // H).transpose(1, 2)
        v = self.v(y).view(b, t, H, D // H).transpose(1, 2)
        if att_cache.size(2) > 0:
            key_cache, value_cache = torch.split(att_cache, att_cache.size(-1) // 2, dim=-1)
            k = torch.cat([key_cache, k], dim=2)
            v = torch.cat([value_cache, v], dim=2)
        new_att_cache = torch.cat((k, v), dim=-1)
        scores = q @ k.transpose(-2, -1) / (D // H) ** 0.5
        if mask.size(2) > 0:  # wenet: "if mask.size(2) > 0" -- the streaming fake mask has size 0
            m = mask.unsqueeze(1).eq(0)
            scores = scores.masked_fill(m, -float("inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(m, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = x + self.o((attn @ v).transpose(1, 2).reshape(b, t, D))
        return x + self.ff(self.n2(x)), new_att_cache


layers = nn.ModuleList(EncoderLayer() for _ in range(LAYERS)).eval()
T = 21  # not a multiple of the chunk: the last chunk is short
xs = torch.randn(1, T, D)

with torch.no_grad():
    # full forward with the decoding chunk mask (add_optional_chunk_mask, decoding_chunk_size > 0)
    chunk_masks = subsequent_chunk_mask(T, DECODING_CHUNK, LEFT_CHUNKS).unsqueeze(0)
    full = xs
    for layer in layers:
        full, _ = layer(full, chunk_masks, torch.zeros(0, 0, 0, 0))

    # forward_chunk_by_chunk
    required_cache_size = DECODING_CHUNK * LEFT_CHUNKS
    att_caches = [torch.zeros(0, 0, 0, 0) for _ in range(LAYERS)]
    outputs, offset = [], 0
    for cur in range(0, T, DECODING_CHUNK):
        chunk = xs[:, cur:cur + DECODING_CHUNK]
        fake_mask = torch.ones((0, 0, 0), dtype=torch.bool)
        for i, layer in enumerate(layers):
            chunk, new_cache = layer(chunk, fake_mask, att_caches[i])
            attention_key_size = new_cache.size(2)
            next_cache_start = max(attention_key_size - required_cache_size, 0)
            att_caches[i] = new_cache[:, :, next_cache_start:, :]
        outputs.append(chunk)
        offset += chunk.size(1)
    streamed = torch.cat(outputs, dim=1)

diff = (full - streamed).abs().max().item()
print(f"max |chunk-masked full forward - forward_chunk_by_chunk|: {diff:.3e}")
assert streamed.shape == full.shape and diff < 1e-10
