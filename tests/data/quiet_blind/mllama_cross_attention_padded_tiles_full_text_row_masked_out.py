"""Llama 3.2 Vision (mllama) cross-attention to padded image tiles.

Follows meta-llama/llama-models, models/llama3/multimodal/model.py: _get_xattn_mask,
_get_full_row_masked_out_mask, CrossAttention.forward and
CrossAttentionTransformerBlock.forward; and the mask construction of transformers
models/mllama/processing_mllama.py (get_cross_attention_token_mask,
convert_sparse_cross_attention_mask_to_dense) with
models/mllama/modeling_mllama.py _prepare_cross_attention_mask.

Each image is cut into up to MAX_TILES tiles; images with fewer tiles are padded with
empty tiles, and samples with fewer images get an empty image slot. The dense
cross_attention_mask (B, text_len, max_images, max_tiles) is 1 where a text token may
read a REAL tile of an image it follows. It is repeated over the vision tokens of each
tile, inverted to an additive mask, and then:
  full_text_row_masked_out_mask = row has at least one visible vision token
  xattn_mask *= full_text_row_masked_out_mask
Text rows before the first <|image|> see no tile at all; their mask is zeroed (so they
attend uniformly to everything, padded tiles included, instead of producing NaN), and
their attention and MLP outputs are multiplied by 0. The block's output must equal a
per-token loop that gathers only the real tiles' tokens and adds nothing for rows that
see none.
"""
import torch

torch.manual_seed(0)
DT = torch.float64
D, H, HD, TOK_PER_TILE, MAX_TILES = 16, 2, 8, 3, 4
IMAGE, PAD = 7, 0


def get_cross_attention_token_mask(input_ids, image_token_id):
    locs = [i for i, t in enumerate(input_ids) if t == image_token_id]
    if len(locs) == 0:
        return []
    if len(locs) == 1:
        return [[locs[0], -1]]
    masks = [[a, b] for a, b in zip(locs[:-1], locs[1:])]
    masks.append([locs[-1], len(input_ids)])
    last_end = masks[-1][1]
    for m in masks[::-1]:
        if m[0] == m[1] - 1:       # consecutive images all attend the text that follows
            m[1] = last_end
        last_end = m[1]
    return masks


def convert_sparse_to_dense(token_masks, num_tiles, max_tiles, length):
    B, max_imgs = len(token_masks), max(len(n) for n in num_tiles)
    dense = torch.zeros(B, length, max_imgs, max_tiles, dtype=torch.int64)
    for b, (sample_masks, sample_tiles) in enumerate(zip(token_masks, num_tiles)):
        for i, ((start, end), n) in enumerate(zip(sample_masks, sample_tiles)):
            end = length if end == -1 else min(end, length)
            dense[b, start:end, i, :n] = 1
    return dense


def get_xattn_mask(cross_attention_mask, num_vision_tokens, dtype):
    B, T = cross_attention_mask.shape[:2]
    m = cross_attention_mask.repeat_interleave(num_vision_tokens, dim=3).view(B, T, -1).unsqueeze(1)
    inv = (1.0 - m).to(dtype)
    m = inv.masked_fill(inv.to(torch.bool), torch.finfo(dtype).min)
    full_row = (m != torch.finfo(dtype).min).any(dim=-1).type_as(m)[..., None]
    m = m * full_row
    return m, full_row


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def block(x, vision, xmask, full_row, p):
    B, T, _ = x.shape
    q = (rms(x) @ p["wq"]).view(B, T, H, HD).transpose(1, 2)
    k = (vision @ p["wk"]).view(B, -1, H, HD).transpose(1, 2)
    v = (vision @ p["wv"]).view(B, -1, H, HD).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=xmask)
    o = o * full_row
    o = o.transpose(1, 2).reshape(B, T, H * HD) @ p["wo"]
    h = x + torch.tanh(p["gate_attn"]) * o
    f = torch.nn.functional.silu(rms(h) @ p["w1"]) @ p["w2"]
    f = f * full_row[:, 0]
    return h + torch.tanh(p["gate_ffwd"]) * f


def main():
    ids = [[1, IMAGE, 5, 6, 8, 9, 4, 3, 2, 5],          # one image, 2 real tiles
           [1, 5, IMAGE, IMAGE, 6, 8, 2, PAD, PAD, PAD],  # two images, 4 and 1 tiles
           [1, 4, 5, IMAGE, 8, 2, IMAGE, 9, 3, PAD]]      # interleaved, 3 and 2 tiles
    num_tiles = [[2], [4, 1], [3, 2]]
    B, T = len(ids), len(ids[0])
    dense = convert_sparse_to_dense([get_cross_attention_token_mask(s, IMAGE) for s in ids],
                                    num_tiles, MAX_TILES, T)
    n_img = dense.shape[2]
    # vision states (B, images, tiles, tokens, D); padded tiles hold arbitrary values
    vision = torch.randn(B, n_img, MAX_TILES, TOK_PER_TILE, D, dtype=DT) * 3
    p = {n: torch.randn(*s, dtype=DT) * 0.3 for n, s in
         [("wq", (D, H * HD)), ("wk", (D, H * HD)), ("wv", (D, H * HD)), ("wo", (H * HD, D)),
          ("w1", (D, 2 * D)), ("w2", (2 * D, D))]}
    p["gate_attn"], p["gate_ffwd"] = torch.tensor(0.7, dtype=DT), torch.tensor(-0.4, dtype=DT)
    x = torch.randn(B, T, D, dtype=DT)

    xmask, full_row = get_xattn_mask(dense, TOK_PER_TILE, DT)
    out = block(x, vision.reshape(B, -1, D), xmask, full_row, p)

    ref = torch.empty_like(x)
    for b in range(B):
        for t in range(T):
            toks = [vision[b, i, j] for i in range(n_img) for j in range(MAX_TILES) if dense[b, t, i, j]]
            xt = x[b, t:t + 1][None]
            if not toks:
                ref[b, t] = x[b, t]   # no image read: both gated branches add nothing
                continue
            vis = torch.cat(toks)[None]
            one = torch.zeros(1, 1, 1, vis.shape[1], dtype=DT)
            ref[b, t] = block(xt, vis, one, torch.ones(1, 1, 1, 1, dtype=DT), p)[0, 0]
    real = torch.tensor([[t != PAD for t in s] for s in ids])
    d = (out - ref)[real].abs().max().item()
    rows_blind = int((full_row[:, 0, :, 0] == 0).sum())
    print(f"text rows that see no tile: {rows_blind}; max|batched-loop| over real tokens = {d:.2e}")
    assert d < 1e-12, d
    print("ok")


if __name__ == "__main__":
    main()
