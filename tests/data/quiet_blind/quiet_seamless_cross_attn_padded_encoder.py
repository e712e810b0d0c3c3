# Correct program. Ported from facebookresearch/seamless_communication (fairseq2-based UnitY decoder):
# encoder self-attention and decoder cross-attention take a key padding mask built from the encoder
# output lengths (seqs_len -> padding mask), speech frames right-padded.
import torch
torch.manual_seed(0)
D, H = 16, 2
enc = torch.nn.MultiheadAttention(D, H, batch_first=True)
cross = torch.nn.MultiheadAttention(D, H, batch_first=True)
src_lens = torch.tensor([6, 3]); tgt = torch.randn(2, 4, D)
src = torch.randn(2, 6, D)
key_padding_mask = torch.arange(6)[None] >= src_lens[:, None]
mem, _ = enc(src, src, src, key_padding_mask=key_padding_mask)
y, _ = cross(tgt, mem, mem, key_padding_mask=key_padding_mask)
for b in range(2):
    n = src_lens[b].item(); s = src[b:b + 1, :n]
    m, _ = enc(s, s, s)
    r, _ = cross(tgt[b:b + 1], m, m)
    assert torch.allclose(y[b:b + 1], r, atol=1e-5)
print("ok")
