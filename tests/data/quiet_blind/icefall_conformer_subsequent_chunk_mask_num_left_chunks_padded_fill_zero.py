"""icefall streaming Conformer: dynamic chunk training with a limited number of left chunks over padded audio.

Follows k2-fsa/icefall, egs/librispeech/ASR/pruned_transducer_stateless2/conformer.py:
  Conformer.forward builds
      src_key_padding_mask = make_pad_mask(lengths)
      mask = ~subsequent_chunk_mask(size=x.size(0), chunk_size=chunk_size,
                                    num_left_chunks=num_left_chunks, device=x.device)
  (subsequent_chunk_mask from icefall/utils.py: True = may attend), and
  RelPositionMultiheadAttention.multi_head_attention_forward fills -inf for attn_mask and key_padding_mask,
  takes the softmax, and then fills 0.0 at the combined mask, with the comment that with a limited
  num_left_chunks a padded frame "may only see the padding values", whose row would be all -inf / nan.
Reduced: rel-pos terms dropped (plain scaled dot product), 2 layers of attention + feed-forward, float64.
Check: every valid frame of the padded batch equals the same utterance run alone, unpadded, through an
explicit per-frame loop over the keys its chunk window allows.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

D, H, LAYERS = 16, 2, 2
CHUNK, LEFT_CHUNKS = 3, 1


def make_pad_mask(lengths):  # icefall/utils.py: True at padded frames
    max_len = int(lengths.max())
    return torch.arange(max_len).expand(lengths.size(0), max_len) >= lengths.unsqueeze(1)


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1):  # icefall/utils.py
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D, 3 * D)
        self.out_proj = nn.Linear(D, D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D))
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def attn(self, x, attn_mask, key_padding_mask):
        # x: (T, N, D) as in icefall (time first)
        T, N, _ = x.shape
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = q.reshape(T, N * H, D // H).transpose(0, 1) * (D // H) ** -0.5
        k = k.reshape(T, N * H, D // H).transpose(0, 1)
        v = v.reshape(T, N * H, D // H).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2))  # (N*H, T, T)
        w = w.masked_fill(attn_mask.unsqueeze(0), float("-inf"))
        w = w.view(N, H, T, T).masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        w = torch.softmax(w, dim=-1)
        combined_mask = attn_mask.unsqueeze(0) | key_padding_mask.unsqueeze(1).unsqueeze(2)
        w = w.masked_fill(combined_mask, 0.0).view(N * H, T, T)  # (N, 1, T, T) over heads
        out = torch.bmm(w, v).transpose(0, 1).reshape(T, N, D)
        return self.out_proj(out)

    def forward(self, x, attn_mask, key_padding_mask):
        x = x + self.attn(self.n1(x), attn_mask, key_padding_mask)
        return x + self.ff(self.n2(x))

    def reference(self, x):  # x: (T, D), one utterance, no padding, explicit loop over allowed keys
        T = x.shape[0]
        y = self.n1(x)
        q, k, v = self.in_proj(y).chunk(3, dim=-1)
        out = torch.zeros(T, D)
        for i in range(T):
            start = max((i // CHUNK - LEFT_CHUNKS) * CHUNK, 0)
            end = min((i // CHUNK + 1) * CHUNK, T)
            for h in range(H):
                sl = slice(h * D // H, (h + 1) * D // H)
                s = (k[start:end, sl] @ q[i, sl]) * (D // H) ** -0.5
                out[i, sl] = torch.softmax(s, 0) @ v[start:end, sl]
        x = x + self.out_proj(out)
        return x + self.ff(self.n2(x))


layers = nn.ModuleList(Layer() for _ in range(LAYERS)).eval()
lengths = torch.tensor([13, 7, 4])
T = int(lengths.max())
feats = torch.randn(len(lengths), T, D)
src_key_padding_mask = make_pad_mask(lengths)
feats = feats.masked_fill(src_key_padding_mask.unsqueeze(-1), 0.0)  # padded fbank frames are zeros

with torch.no_grad():
    x = feats.transpose(0, 1)  # (T, N, D)
    mask = ~subsequent_chunk_mask(size=x.size(0), chunk_size=CHUNK, num_left_chunks=LEFT_CHUNKS)
    for layer in layers:
        x = layer(x, mask, src_key_padding_mask)
    batched = x.transpose(0, 1)
    assert torch.isfinite(batched).all()

    worst = 0.0
    for b, n in enumerate(lengths.tolist()):
        y = feats[b, :n]
        for layer in layers:
            y = layer.reference(y)
        worst = max(worst, (batched[b, :n] - y).abs().max().item())
print(f"max |padded chunked batch - per-utterance loop| over valid frames: {worst:.3e}")
assert worst < 1e-10
