"""NeMo Conformer with limited, asymmetric attention context (more left than right).

Follows NVIDIA/NeMo nemo/collections/asr/modules/conformer_encoder.py
(ConformerEncoder._create_masks with att_context_style="regular":
att_mask.triu(diagonal=-att_context_size[0]).tril(diagonal=att_context_size[1]),
then `& pad_mask` on both axes and inverted so True means masked) and
nemo/collections/asr/parts/submodules/multi_head_attention.py
(MultiHeadAttention.forward_attention: scores.masked_fill(mask, -10000), softmax,
then attn.masked_fill(mask, 0.0), so padded frames come out as zeros), not pinned.
att_context_size = [4, 1]: each frame sees 4 past frames and 1 future frame, a
small lookahead on purpose for low-latency ASR. Lengths pass through the 4x
conv subsampling (calc_length) before the mask is built.
Reference: each utterance alone, unpadded, with an explicit per-frame key range.
"""
import torch

torch.manual_seed(0)
D, H, HD = 32, 4, 8
ATT_CONTEXT = [4, 1]
linear_q, linear_k, linear_v = (torch.nn.Linear(D, D) for _ in range(3))


def calc_length(lengths, n_layers=2, kernel=3, stride=2, pad=1):
    """nemo subsampling.calc_length for two stride-2 convs."""
    lengths = lengths.float()
    for _ in range(n_layers):
        lengths = torch.floor((lengths + 2 * pad - kernel) / stride + 1)
    return lengths.long()


def create_masks(length, max_len):
    att_mask = torch.ones(1, max_len, max_len, dtype=torch.bool)
    att_mask = att_mask.triu(diagonal=-ATT_CONTEXT[0])
    att_mask = att_mask.tril(diagonal=ATT_CONTEXT[1])
    pad_mask = torch.arange(max_len)[None] < length[:, None]          # True = real
    pad_mask_for_att = pad_mask.unsqueeze(1).repeat(1, max_len, 1)
    pad_mask_for_att = pad_mask_for_att & pad_mask_for_att.transpose(1, 2)
    att_mask = att_mask & pad_mask_for_att
    return ~pad_mask, ~att_mask                                        # True = masked


def mha(x, mask):
    b, t, _ = x.shape
    q, k, v = (lin(x).view(b, t, H, HD).transpose(1, 2) for lin in (linear_q, linear_k, linear_v))
    scores = q @ k.transpose(-1, -2) / HD ** 0.5
    m = mask.unsqueeze(1)
    scores = scores.masked_fill(m, -10000.0)
    attn = torch.softmax(scores, dim=-1).masked_fill(m, 0.0)
    return (attn @ v).transpose(1, 2).reshape(b, t, D)


audio_lengths = torch.tensor([64, 41, 23])                 # feature frames before subsampling
lengths = calc_length(audio_lengths)                       # -> [16, 11, 6]
T = int(lengths.max())
x = torch.randn(3, T, D)

with torch.no_grad():
    pad_mask, att_mask = create_masks(lengths, T)
    x = x.masked_fill(pad_mask[..., None], 0.0)
    out = mha(x, att_mask)

    worst = 0.0
    for b, n in enumerate(lengths.tolist()):
        xb = x[b, :n]
        q, k, v = (lin(xb).view(n, H, HD).transpose(0, 1) for lin in (linear_q, linear_k, linear_v))
        for t in range(n):
            lo, hi = max(0, t - ATT_CONTEXT[0]), min(n, t + ATT_CONTEXT[1] + 1)
            p = (q[:, t:t + 1] @ k[:, lo:hi].transpose(-1, -2) / HD ** 0.5).softmax(-1)
            ref = (p @ v[:, lo:hi]).reshape(D)
            worst = max(worst, (ref - out[b, t]).abs().max().item())
        assert out[b, n:].abs().max().item() == 0 if n < T else True   # padded frames zeroed

print("frames after subsampling:", lengths.tolist())
print(f"context [4, 1] masked attention vs per-frame loop, max diff {worst:.2e}")
assert worst < 1e-5
