"""Decoder-only prefix LM with a per-row prefix boundary (t5x style), right-padded batch.

Follows google-research/t5x t5x/examples/decoder_only/network.py (Decoder.__call__ with
decoder_causal_attention) and flaxformer/t5x layers: make_decoder_mask(decoder_target_tokens,
decoder_causal_attention=...) = causal mask OR (inputs_q AND inputs_k) for the prefix, AND
make_attention_mask(target_tokens > 0, target_tokens > 0) for padding; then combine_biases turns it
into a -1e10 bias added to the logits before a plain softmax. decoder_causal_attention is 1 on the
prefix ("inputs") of each row, a different length per row, as seqio's
PrefixLM / DecoderFeatureConverter sets it. Hand-written softmax attention. Reference: each row alone,
unpadded, with its mask built by a loop; also checks prefix outputs do not depend on the targets.
"""
import torch

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 40, 2
rows = [(4, 3), (1, 5), (6, 2)]  # (prefix length, target length)
emb = torch.nn.Embedding(V, D).double()
pos_emb = torch.nn.Embedding(16, D).double()
layers = [dict(qkv=torch.nn.Linear(D, 3 * H * HD, bias=False).double(), o=torch.nn.Linear(H * HD, D, bias=False).double(),
               mlp=torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.ReLU(), torch.nn.Linear(64, D)).double())
          for _ in range(NL)]


def make_decoder_mask(decoder_target_tokens, decoder_causal_attention):
    n = decoder_target_tokens.shape[-1]
    idx = torch.arange(n)
    causal = (idx[None, :, None] >= idx[None, None, :])
    inputs = decoder_causal_attention.bool()
    bidir = inputs[:, :, None] & inputs[:, None, :]
    valid = decoder_target_tokens > 0
    pad = valid[:, :, None] & valid[:, None, :]
    return ((causal | bidir) & pad)[:, None]  # (b, 1, q, k)


def forward(tokens, mask):
    b, n = tokens.shape
    h = emb(tokens) + pos_emb(torch.arange(n))
    bias = torch.where(mask, 0.0, -1e10).double()
    for ly in layers:
        q, k, v = ly["qkv"](h).view(b, n, 3, H, HD).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / HD ** 0.5 + bias
        w = torch.softmax(logits, -1)
        h = h + ly["o"]((w @ v).transpose(1, 2).reshape(b, n, H * HD))
        h = h + ly["mlp"](h)
    return h


seqs = [torch.randint(1, V, (p + t,)) for p, t in rows]
B, L = len(rows), max(p + t for p, t in rows)
tokens = torch.zeros(B, L, dtype=torch.long)
dca = torch.zeros(B, L, dtype=torch.long)
for i, ((p, t), s) in enumerate(zip(rows, seqs)):
    tokens[i, :p + t] = s
    dca[i, :p] = 1

with torch.no_grad():
    out = forward(tokens, make_decoder_mask(tokens, dca))
    maxdiff = 0.0
    for i, ((p, t), s) in enumerate(zip(rows, seqs)):
        n = p + t
        m = torch.tensor([[j <= q or (q < p and j < p) for j in range(n)] for q in range(n)])
        ref = forward(s[None], m[None, None])
        maxdiff = max(maxdiff, (out[i, :n] - ref[0]).abs().max().item())
    # the prefix is encoded bidirectionally but never sees the targets
    tokens2 = tokens.clone()
    for i, (p, t) in enumerate(rows):
        tokens2[i, p:p + t] = torch.randint(1, V, (t,))
    out2 = forward(tokens2, make_decoder_mask(tokens2, dca))
    prefix_diff = max((out[i, :p] - out2[i, :p]).abs().max().item() for i, (p, t) in enumerate(rows))
print("max |batched - per-row unpadded| =", maxdiff, " prefix change when targets change =", prefix_diff)
assert maxdiff < 1e-10 and prefix_diff < 1e-12
