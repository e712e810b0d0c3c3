"""A streaming encoder's chunks, each right-padded, the state packed per row before the next chunk (quiet).

Each sequence of a batch of two arrives in chunks of frames, every chunk right-padded to the batch's longest. The
layer keeps, per row, only the real frames it has seen (the state), and joins the next chunk's frames right after
them: row 1's first chunk holds 3 real frames of 5, so its second chunk's frames sit at key columns 3..6 while row
0's sit at 5..8, and each query frame t of the chunk sees the state and the chunk's frames up to itself (its own key
count, prev_len + t + 1, as RETURNN's fixed CausalSelfAttention gives it). The key axis is the batch's longest
joined length, the shorter row's right-padded. Self-check: every real frame's output matches the whole sequence run
at once, causal.
"""
import torch

torch.manual_seed(0)
D = 8
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))


def attend(q, k, v, keep):
    scores = (q @ k.transpose(-1, -2)) / D ** 0.5
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def chunk(frames, lengths, state_k, state_v, state_lens):
    """frames (B, T, D) right-padded to `lengths`; the state (B, S, D) right-padded to `state_lens`."""
    B, T, _ = frames.shape
    joined = int((state_lens + lengths).max())
    k = torch.zeros(B, joined, D)
    v = torch.zeros(B, joined, D)
    for b in range(B):  # (the row's real state, then its chunk's real frames, packed)
        s, n = int(state_lens[b]), int(lengths[b])
        k[b, :s], v[b, :s] = state_k[b, :s], state_v[b, :s]
        k[b, s:s + n], v[b, s:s + n] = wk(frames[b, :n]), wv(frames[b, :n])
    seen = state_lens[:, None] + torch.arange(T)[None, :] + 1  # (B, T): each query's own key count
    keep = torch.arange(joined)[None, None, :] < seen[:, :, None]
    return attend(wq(frames), k, v, keep), k, v, state_lens + lengths


with torch.no_grad():
    first, second = torch.tensor([5, 3]), torch.tensor([4, 4])
    x1, x2 = torch.randn(2, 5, D), torch.randn(2, 4, D)
    empty = torch.zeros(2, 0, D)
    out1, k, v, lens = chunk(x1, first, empty, empty, torch.tensor([0, 0]))
    out2, _, _, _ = chunk(x2, second, k, v, lens)
    for b in range(2):
        whole = torch.cat([x1[b, :first[b]], x2[b, :second[b]]])[None]
        n = whole.shape[1]
        ref = attend(wq(whole), wk(whole), wv(whole), torch.ones(n, n, dtype=torch.bool).tril())[0]
        assert torch.allclose(out1[b, :first[b]], ref[:first[b]], atol=1e-5), b
        assert torch.allclose(out2[b, :second[b]], ref[first[b]:], atol=1e-5), b
print("every real frame matches the whole sequence at once")
