# Correct program. Ported from facebookresearch/blt @9774ed4fcc78313f9f218295f3d7e4decdadf2ae:
# bytelatent/model/blt.py (patch_ids_from_lengths, decoder_patch_ids_from_lengths, create_patch_mask_from_ids,
# cross_attn_mask with block_mask=True -> create_block_mask(patch_mask, B=bs, H=None, ...), and
# ByteLatentTransformer.forward's encoder cross-attention (patches_as_queries=True) and decoder
# cross-attention (bytes as queries)), bytelatent/model/latent_transformer.py (CrossAttention: flex_attention
# with the BlockMask), bytelatent/model/local_models.py (LocalEncoder.apply_cross_attention with
# cross_attn_init_by_pooling, LocalDecoder's patch projection) and bytelatent/model/utils.py (create_causal_mask
# attn_impl="flex_attention", patch_reduce). Dynamic patching: patch lengths vary per row and the second row
# has a trailing zero-length patch. The global transformer is one causal flex layer over patches.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
flex_attention_comp = flex_attention


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def create_causal_mask(seqlen, attn_impl, attn_bias_type, *, eos_id=None, tokens=None, sliding_window=None):
    if attn_impl == "flex_attention":
        return create_block_mask(causal_mask, None, None, seqlen, seqlen, device="cpu")
    raise NotImplementedError(attn_impl)


def patch_ids_from_lengths(patch_lengths, seq_len):
    bs, num_patches = patch_lengths.shape
    cum_d = torch.cat([torch.zeros(bs, 1, dtype=patch_lengths.dtype), patch_lengths.cumsum(dim=-1)], dim=-1)
    patch_ids = (cum_d.unsqueeze(-1) <= torch.arange(seq_len)).sum(dim=-2) - 1
    assert not (torch.max(patch_ids) > patch_lengths.shape[-1] or torch.min(patch_ids) < 0)
    return patch_ids


def decoder_patch_ids_from_lengths(patch_lengths, nb_boe, seq_len):
    first_patch_length = patch_lengths[0, 0]
    assert torch.all(first_patch_length == patch_lengths[:, 0])
    assert first_patch_length - nb_boe == 1
    decoder_patch_lengths = patch_lengths[:, 1:]
    assert decoder_patch_lengths.sum() + (nb_boe + 1) * patch_lengths.shape[0] == patch_lengths.sum()
    return patch_ids_from_lengths(patch_lengths=decoder_patch_lengths, seq_len=seq_len)


def create_patch_mask_from_ids(patch_ids, num_patches, window=None, patches_as_queries=False):
    bs, seq_len = patch_ids.shape
    if not patches_as_queries:
        q_ids = patch_ids.unsqueeze(-1).expand(bs, seq_len, num_patches)
        kv_ids = torch.arange(num_patches).unsqueeze(0).unsqueeze(0).expand(bs, seq_len, num_patches)
    else:
        kv_ids = patch_ids.unsqueeze(1).expand(bs, num_patches, seq_len)
        q_ids = torch.arange(num_patches).unsqueeze(0).unsqueeze(-1).expand(bs, num_patches, seq_len)
    if window is None:
        mask = q_ids == kv_ids
    else:
        mask = (kv_ids <= q_ids) & (q_ids < kv_ids + window)
    return mask


def cross_attn_mask(patch_ids, patch_lengths, N, patches_as_queries=False, cross_attn_k=1, window=None, block_mask=True):
    bs = patch_ids.shape[0]
    with torch.no_grad():
        cross_mask = create_patch_mask_from_ids(
            patch_ids, patch_lengths.shape[1], window=window, patches_as_queries=patches_as_queries
        ).repeat_interleave(cross_attn_k, dim=1 if patches_as_queries else -1)
        q_len = patch_lengths.shape[1] * cross_attn_k if patches_as_queries else N
        kv_len = N if patches_as_queries else patch_lengths.shape[1] * cross_attn_k
        assert cross_mask.shape == (bs, q_len, kv_len)
        if block_mask:
            def patch_mask(b, h, q_idx, kv_idx):
                return cross_mask[b, q_idx, kv_idx]
            return create_block_mask(patch_mask, B=bs, H=None, Q_LEN=q_len, KV_LEN=kv_len, device="cpu")
        return torch.where(cross_mask, torch.tensor(0.0), torch.tensor(float("-inf"))).unsqueeze(1)


def patch_reduce(h, max_num_patches, reduction, patch_ids):
    bs, seq_len, emb_dim = h.shape
    patch_ids = patch_ids.unsqueeze(-1).expand(-1, -1, h.shape[-1])
    reduced_embs = torch.zeros((bs, max_num_patches, emb_dim), dtype=h.dtype)
    reduced_embs = reduced_embs.scatter_reduce(src=h, dim=1, index=patch_ids, reduce=reduction, include_self=False)
    return reduced_embs[:, :max_num_patches, :]


class SelfAttention(nn.Module):  # base_transformer.Attention, flex_attention branch (no rope here)
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, mask=None):
        bsz, seq_len, dim = x.shape
        xq, xk, xv = (w(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        assert mask is None or not isinstance(mask, torch.Tensor)
        output = flex_attention_comp(xq, xk, xv, block_mask=mask).transpose(1, 2).contiguous()
        return x + self.wo(output.reshape(bsz, seq_len, dim))


class CrossAttention(nn.Module):
    def __init__(self, dim, head_dim, n_heads, n_kv_heads, norm_eps):
        super().__init__()
        self.dim, self.head_dim, self.n_heads, self.n_kv_heads = dim, head_dim, n_heads, n_kv_heads
        self.cross_attn_norm_q = nn.RMSNorm(dim, eps=norm_eps)
        self.cross_attn_norm_kv = nn.RMSNorm(dim, eps=norm_eps)
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, kv, mask=None):
        bsz, seq_len, _ = x.shape
        _, slen_kv, _ = kv.shape
        x_norm = self.cross_attn_norm_q(x)
        kv = self.cross_attn_norm_kv(kv)
        xq, xk, xv = self.wq(x_norm), self.wk(kv), self.wv(kv)
        output_shape = xq.shape
        xq = xq.view(bsz, seq_len, self.n_heads, self.head_dim)
        xk = xk.view(bsz, slen_kv, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, slen_kv, self.n_kv_heads, self.head_dim)
        xq, xk, xv = map(lambda e: e.transpose(1, 2), (xq, xk, xv))
        output = flex_attention_comp(xq, xk, xv, block_mask=mask)
        output = output.transpose(1, 2).contiguous()
        return x + self.wo(output.reshape(output_shape))


dim, n_heads, cross_attn_k, vocab = 16, 2, 2, 260
tok_embeddings = nn.Embedding(vocab, dim)
enc_layer = SelfAttention(dim, n_heads)
enc_patch_proj = nn.Linear(dim, dim * cross_attn_k, bias=False)  # cross_attn_init_by_pooling projection
enc_cross = CrossAttention(dim, dim // n_heads, n_heads, n_heads, 1e-5)
global_layer = SelfAttention(dim * cross_attn_k, n_heads)
dec_patch_proj = nn.Linear(dim * cross_attn_k, dim * cross_attn_k, bias=False)
dec_cross = CrossAttention(dim, dim // n_heads, n_heads, n_heads, 1e-5)

bs, N, nb_boe = 2, 12, 0
tokens = torch.randint(4, vocab, (bs, N))
# entropy patcher output with include_next_token=True: lengths sum to N + 1, first patch is 1 byte,
# row 1 has fewer patches (right zero-length patch)
patch_lengths = torch.tensor([[1, 3, 4, 2, 3], [1, 5, 2, 5, 0]])
num_patches = patch_lengths.shape[1]

with torch.no_grad():
    patch_ids = patch_ids_from_lengths(patch_lengths, N)
    cross_attn_mask_enc = cross_attn_mask(patch_ids, patch_lengths, N, patches_as_queries=True, cross_attn_k=cross_attn_k)
    # local encoder
    h = tok_embeddings(tokens)
    h_encoder = enc_layer(h, mask=create_causal_mask(N, "flex_attention", "local_block_causal"))
    patch_embeds = patch_reduce(h_encoder, num_patches, "amax", patch_ids)
    patch_embeds = enc_patch_proj(patch_embeds).reshape(bs, num_patches * cross_attn_k, dim)
    h_cross = patch_embeds + enc_cross(x=patch_embeds, kv=h_encoder, mask=cross_attn_mask_enc)  # apply_cross_attention
    h_patch = h_cross.view(bs, num_patches, -1)
    # global transformer over patches
    h_global = global_layer(h_patch, mask=create_causal_mask(num_patches, "flex_attention", "causal"))
    # local decoder cross-attention: bytes query the patch slots of their decoder patch
    decoder_patch_ids = decoder_patch_ids_from_lengths(patch_lengths, nb_boe, N)
    assert torch.max(decoder_patch_ids) + 1 <= h_global.shape[1]
    cross_attn_mask_dec = cross_attn_mask(decoder_patch_ids, patch_lengths, N, patches_as_queries=False, cross_attn_k=cross_attn_k)
    dec_patch_embeds = dec_patch_proj(h_global).reshape(bs, num_patches * cross_attn_k, dim)
    h_dec = dec_cross(x=h_encoder, kv=dec_patch_embeds, mask=cross_attn_mask_dec)

    # ---- references: every attention run alone on exactly the rows it may see, without a mask ----
    for b in range(bs):
        ref = F.scaled_dot_product_attention(
            *(w(h[b:b + 1]).view(1, N, n_heads, -1).transpose(1, 2) for w in (enc_layer.wq, enc_layer.wk, enc_layer.wv)),
            is_causal=True).transpose(1, 2).reshape(1, N, dim)
        assert torch.allclose(h_encoder[b:b + 1], h[b:b + 1] + enc_layer.wo(ref), atol=1e-5)
        start = 0
        for p in range(num_patches):
            L = int(patch_lengths[b, p])
            stop = min(start + L, N)
            slots = slice(p * cross_attn_k, (p + 1) * cross_attn_k)
            if stop > start:
                bytes_p = h_encoder[b:b + 1, start:stop]
                assert torch.allclose(patch_embeds[b, p * cross_attn_k], enc_patch_proj(bytes_p.amax(1))[0, :dim], atol=1e-6)
                ref = patch_embeds[b:b + 1, slots] + enc_cross(x=patch_embeds[b:b + 1, slots], kv=bytes_p, mask=None)
                assert torch.allclose(h_cross[b:b + 1, slots], ref, atol=1e-5), (b, p)
            else:  # a zero-length patch has no bytes: its slots receive nothing
                assert torch.allclose(h_cross[b, slots], 2 * patch_embeds[b, slots])
            start += L
        for p in range(num_patches):
            q = h_patch[b:b + 1, :p + 1]
            ref = global_layer.wo(F.scaled_dot_product_attention(
                *(w(q).view(1, p + 1, n_heads, -1).transpose(1, 2) for w in (global_layer.wq, global_layer.wk, global_layer.wv)),
                is_causal=True).transpose(1, 2).reshape(1, p + 1, -1))[:, -1] + h_patch[b:b + 1, p]
            assert torch.allclose(h_global[b:b + 1, p], ref, atol=1e-5)
        dec_lengths = patch_lengths[b, 1:].tolist()
        i = 0
        for j, L in enumerate(dec_lengths):
            for _ in range(L):
                ref = dec_cross(x=h_encoder[b:b + 1, i:i + 1],
                                kv=dec_patch_embeds[b:b + 1, j * cross_attn_k:(j + 1) * cross_attn_k], mask=None)
                assert torch.allclose(h_dec[b:b + 1, i:i + 1], ref, atol=1e-5), (b, i)
                i += 1
        assert i == N
print("ok")
