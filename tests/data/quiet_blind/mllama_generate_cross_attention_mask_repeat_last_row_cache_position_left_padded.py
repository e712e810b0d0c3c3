"""Mllama generation: the cross-attention mask grows by repeating its last text row.

Follows transformers models/mllama: processing_mllama.py (get_cross_attention_token_mask
and convert_sparse_cross_attention_mask_to_dense, run on the LEFT-padded input_ids, so
the image spans are in padded coordinates), modeling_mllama.py
MllamaForConditionalGeneration.forward (cross_attention_mask[:, :, cache_position] and
full_text_row_masked_out_mask[:, :, cache_position] after _prepare_cross_attention_mask)
and _update_model_kwargs_for_generation, which extends the mask for every generated
token with  cat([mask, mask[:, -1:, ...]], dim=1) : a new token sees exactly the tiles
the last prompt token saw (it is "after" the same images).
Self-attention uses the left-padding attention_mask with cumsum position ids and a KV
cache; cross-attention reads real tiles only, and rows that see no tile (pads and text
before the first image) are zeroed by full_text_row_masked_out_mask.
Check: greedy decoding of the batch gives the same tokens and logits as each sample
alone, unpadded, recomputed from scratch at every step with a mask built from its whole
current sequence (the last image's span runs to the end of the text).
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
DT = torch.float64
D, H, HD, TOK, TILES, V = 16, 2, 8, 2, 3, 24
IMAGE, PAD, STEPS = 7, 0, 4


def token_mask(ids):
    locs = [i for i, t in enumerate(ids) if t == IMAGE]
    if not locs:
        return []
    if len(locs) == 1:
        return [[locs[0], -1]]
    m = [[a, b] for a, b in zip(locs[:-1], locs[1:])] + [[locs[-1], len(ids)]]
    last = m[-1][1]
    for x in m[::-1]:
        if x[0] == x[1] - 1:
            x[1] = last
        last = x[1]
    return m


def dense(masks, num_tiles, length):
    out = torch.zeros(len(masks), length, max(len(n) for n in num_tiles), TILES)
    for b, (sm, nt) in enumerate(zip(masks, num_tiles)):
        for i, ((s, e), n) in enumerate(zip(sm, nt)):
            out[b, s:(length if e == -1 else min(e, length)), i, :n] = 1
    return out


def prepare(cm):  # _prepare_cross_attention_mask
    B, T = cm.shape[:2]
    cm = cm.repeat_interleave(TOK, dim=3).view(B, T, -1).unsqueeze(1)
    inv = (1.0 - cm).to(DT)
    cm = inv.masked_fill(inv.bool(), torch.finfo(DT).min)
    full = (cm != torch.finfo(DT).min).any(-1).type_as(cm)[..., None]
    return cm * full, full


W = {n: torch.randn(*s, dtype=DT) * 0.3 for n, s in [("emb", (V, D)), ("q", (D, D)), ("k", (D, D)), ("v", (D, D)),
     ("o", (D, D)), ("xq", (D, D)), ("xk", (D, D)), ("xv", (D, D)), ("xo", (D, D)), ("head", (D, V))]}


def rope(x, pos):
    inv = 1.0 / 10000 ** (torch.arange(0, HD, 2, dtype=DT) / HD)
    a = pos[..., None].to(DT) * inv
    c, s = torch.cos(a)[:, None], torch.sin(a)[:, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


def forward(ids, pos, self_mask, cache, vision, xmask, full):
    B, T = ids.shape
    x = W["emb"][ids]
    q, k, v = ((x @ W[n]).view(B, T, H, HD).transpose(1, 2) for n in "qkv")
    q, k = rope(q, pos), rope(k, pos)
    if cache is not None:
        k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask)
    x = x + a.transpose(1, 2).reshape(B, T, D) @ W["o"]
    xq = (x @ W["xq"]).view(B, T, H, HD).transpose(1, 2)
    xk, xv = ((vision @ W[n]).view(B, -1, H, HD).transpose(1, 2) for n in ("xk", "xv"))
    xa = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=xmask) * full
    x = x + xa.transpose(1, 2).reshape(B, T, D) @ W["xo"]
    return x @ W["head"], (k, v)


def self_mask_for(attn_2d, q_len):  # causal over the cache + key padding, additive
    kv_len = attn_2d.shape[1]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    ok = causal[None, None] & attn_2d[:, None, None, :].bool()
    return torch.zeros(ok.shape, dtype=DT).masked_fill(~ok, torch.finfo(DT).min)


def main():
    prompts = [[1, IMAGE, 5, 6, 8], [1, 4, IMAGE, 9, IMAGE, 3, 2, 5]]
    num_tiles = [[2], [3, 1]]
    n_img = max(map(len, num_tiles))
    vision = torch.randn(len(prompts), n_img, TILES, TOK, D, dtype=DT) * 2  # padded tiles: junk
    P = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    attn = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in prompts])[:, None]).long()
    cross = dense([token_mask(r.tolist()) for r in ids], num_tiles, P)
    vis = vision.reshape(len(prompts), -1, D)

    cache, cur, gen, logits_b = None, ids, [], []
    cache_position = torch.arange(P)
    for step in range(STEPS):
        xmask, full = prepare(cross)
        xmask, full = xmask[:, :, cache_position], full[:, :, cache_position]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, cache_position]
        logits, cache = forward(cur, pos, self_mask_for(attn, len(cache_position)), cache, vis, xmask, full)
        nxt = logits[:, -1].argmax(-1)
        gen.append(nxt)
        logits_b.append(logits[:, -1])
        cur = nxt[:, None]
        attn = torch.cat([attn, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
        cross = torch.cat([cross, cross[:, -1:]], 1)       # _update_model_kwargs_for_generation
        cache_position = cache_position[-1:] + 1
    gen = torch.stack(gen, 1)

    worst = 0.0
    for b, p in enumerate(prompts):  # alone, unpadded, no cache, mask from the whole sequence
        seq = list(p)
        for step in range(STEPS):
            t = torch.tensor([seq])
            xm, fl = prepare(dense([token_mask(seq)], [num_tiles[b]], len(seq)))
            vb = vision[b:b + 1, :len(num_tiles[b])].reshape(1, -1, D)
            xm = xm[..., : vb.shape[1]]
            lg, _ = forward(t, torch.arange(len(seq))[None], self_mask_for(torch.ones(1, len(seq)), len(seq)),
                            None, vb, xm, fl)
            worst = max(worst, (lg[0, -1] - logits_b[step][b]).abs().max().item())
            seq.append(int(lg[0, -1].argmax()))
        assert seq[len(p):] == gen[b].tolist(), (seq, gen[b])
    print("generated:", gen.tolist())
    print(f"max|batched cached logits - alone recomputed| = {worst:.2e}")
    assert worst < 1e-12, worst
    print("ok")


if __name__ == "__main__":
    main()
