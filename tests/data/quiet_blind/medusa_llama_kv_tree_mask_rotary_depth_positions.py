# Follows FasterDecoding/Medusa medusa/model/utils.py generate_medusa_buffers (medusa_attn_mask, medusa_position_ids =
# depth) and medusa/model/modeling_llama_kv.py _prepare_decoder_attention_mask, which writes the tree mask into the
# lower-right corner of the causal mask: combined[:, :, -tree_len:, -tree_len:][medusa_mask == 0] = min.
import torch
torch.manual_seed(0); dt = torch.float64; D = 32; nh = 2; hd = D // nh
Wq, Wk, Wv, Wo = [torch.randn(D, D, dtype=dt) / 5 for _ in range(4)]
emb = torch.randn(50, D, dtype=dt)

def rope(x, pos):  # x (..., L, hd), pos (L,)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=dt) / hd))
    f = pos[:, None].to(dt) * inv[None]; e = torch.cat([f, f], -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * e.cos() + torch.cat([-x2, x1], -1) * e.sin()

def layer(x, pos, bias, past=None):
    L = x.shape[0]
    q = rope((x @ Wq).view(L, nh, hd).transpose(0, 1), pos)
    k = rope((x @ Wk).view(L, nh, hd).transpose(0, 1), pos); v = (x @ Wv).view(L, nh, hd).transpose(0, 1)
    if past is not None: k = torch.cat([past[0], k], 1); v = torch.cat([past[1], v], 1)
    a = (q @ k.transpose(-1, -2)) / hd ** 0.5 + bias
    return (a.softmax(-1) @ v).transpose(0, 1).reshape(L, D) @ Wo, (k, v)

# medusa_choices: each tuple is a path of top-k indices per head; root token is index 0 of the tree
medusa_choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2, 0), (0, 1, 0)]
sorted_choices = sorted(medusa_choices, key=lambda x: (len(x), x))
tree_len = len(sorted_choices) + 1
medusa_attn_mask = torch.eye(tree_len, tree_len); medusa_attn_mask[:, 0] = 1
for i, c in enumerate(sorted_choices):
    for j in range(len(c) - 1):
        medusa_attn_mask[i + 1, sorted_choices.index(c[: j + 1]) + 1] = 1   # ancestors
medusa_position_ids = torch.tensor([0] + [len(c) for c in sorted_choices])

# prefill a prompt, then verify the tree in one forward pass with the cache
prompt = torch.randint(0, 50, (7,)); P = len(prompt)
cm = torch.full((P, P), torch.finfo(dt).min, dtype=dt).triu(1)
_, past = layer(emb[prompt], torch.arange(P), cm)
tree_tok = torch.randint(0, 50, (tree_len,))
combined = torch.full((tree_len, P + tree_len), torch.finfo(dt).min, dtype=dt)
combined[:, :P] = 0; combined[:, P:] = torch.full((tree_len, tree_len), torch.finfo(dt).min, dtype=dt).triu(1)
combined[:, -tree_len:][medusa_attn_mask == 0] = torch.finfo(dt).min   # Medusa's overwrite of the corner
tree_out, _ = layer(emb[tree_tok], medusa_position_ids + P, combined, past)

# reference: every node's root-to-node path run as a plain causal sequence after the prompt, no cache
md = 0.0
for i in range(tree_len):
    path = [0] if i == 0 else [0] + [sorted_choices.index(sorted_choices[i - 1][: j + 1]) + 1 for j in range(len(sorted_choices[i - 1]))]
    seq = torch.cat([prompt, tree_tok[path]]); L = len(seq)
    out, _ = layer(emb[seq], torch.arange(L), torch.full((L, L), float("-inf"), dtype=dt).triu(1))
    md = max(md, (out[-1] - tree_out[i]).abs().max().item())
print("max diff", md); assert md < 1e-10
