# Follows torchtune torchtune/generation/_generation.py generate(): get_causal_mask_from_padding_mask (tril over the
# whole cache, pad keys cleared, diagonal forced True so left-pad query rows see themselves instead of nothing) and
# get_position_ids_from_padding_mask; each decode step takes masks[:, curr_pos, None, :] over a static KV cache.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def get_causal_mask_from_padding_mask(padding_mask, target_seq_len=None):
    bsz, seq_len = padding_mask.shape
    target_seq_len = seq_len if target_seq_len is None else target_seq_len
    mask = torch.tril(torch.ones(seq_len, target_seq_len, dtype=torch.bool)).repeat(bsz, 1, 1)
    mask.narrow(2, 0, seq_len).mul_(padding_mask[:, None, :].expand(-1, seq_len, -1))
    mask.diagonal(dim1=1, dim2=2).copy_(torch.Tensor([True]))
    return mask


def get_position_ids_from_padding_mask(padding_mask):
    return ((padding_mask.cumsum(-1) - 1) * padding_mask).to(torch.int)


def rope(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2) / d)
    ang = pos[..., None].to(x.dtype) * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


V, d_model, H, n_layers = 40, 32, 4, 2
Dh = d_model // H
emb = torch.randn(V, d_model)
Ws = [[torch.randn(d_model, d_model) / d_model ** 0.5 for _ in range(4)] for _ in range(n_layers)]


class Model:
    def __init__(self, bsz, max_len):
        self.k = [torch.zeros(bsz, H, max_len, Dh) for _ in range(n_layers)]
        self.v = [torch.zeros(bsz, H, max_len, Dh) for _ in range(n_layers)]

    def __call__(self, tokens, input_pos, mask, cache_pos=None):
        x = emb[tokens]
        B, S, _ = x.shape
        for l, (wq, wk, wv, wo) in enumerate(Ws):
            q = rope((x @ wq).view(B, S, H, Dh).transpose(1, 2), input_pos)
            k = rope((x @ wk).view(B, S, H, Dh).transpose(1, 2), input_pos)
            v = (x @ wv).view(B, S, H, Dh).transpose(1, 2)
            if cache_pos is not None:  # static KVCache.update: write at cache positions, attend over the whole cache
                self.k[l][:, :, cache_pos] = k
                self.v[l][:, :, cache_pos] = v
                k, v = self.k[l], self.v[l]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            x = x + o.transpose(1, 2).reshape(B, S, d_model) @ wo
        return x @ emb.T


prompts = [[3, 8, 1, 9, 4, 7], [5, 2], [6, 6, 11, 12]]
max_new = 5
prompt_len = max(len(p) for p in prompts)
total = prompt_len + max_new
pad_id = 0
tokens = torch.tensor([[pad_id] * (prompt_len - len(p)) + p for p in prompts])  # left padded
padding_mask = tokens != pad_id
padding_mask = F.pad(padding_mask, (0, max_new), value=True)
masks = get_causal_mask_from_padding_mask(padding_mask, target_seq_len=total)
input_pos = get_position_ids_from_padding_mask(padding_mask)

model = Model(len(prompts), total)
logits = model(tokens, input_pos[:, :prompt_len], masks[:, :prompt_len], cache_pos=torch.arange(prompt_len))
step_logits = [logits[:, -1]]
generated = [logits[:, -1].argmax(-1)]
for curr_pos in range(prompt_len, total - 1):
    tok = generated[-1][:, None]
    logits = model(tok, input_pos[:, curr_pos, None], masks[:, curr_pos, None, :], cache_pos=torch.tensor([curr_pos]))
    step_logits.append(logits[:, -1])
    generated.append(logits[:, -1].argmax(-1))
gen = torch.stack(generated, 1)
step_logits = torch.stack(step_logits, 1)

# reference: each prompt alone, unpadded, no cache, full causal recompute after appending the generated tokens
diff = 0.0
for b, p in enumerate(prompts):
    seq = torch.tensor([p + gen[b, :-1].tolist()])
    n = seq.shape[1]
    ref = Model(1, n)(seq, torch.arange(n)[None], torch.tril(torch.ones(1, n, n, dtype=torch.bool)))
    diff = max(diff, (ref[0, len(p) - 1:] - step_logits[b]).abs().max().item())
print(f"generated: {gen.tolist()}; max abs diff (left-padded cached decode vs each prompt alone): {diff:.3e}")
assert diff < 1e-10
