# Citation: lightseekorg/tokenspeed#469 ("fix(mla): apply MTP causal mask in BF16/FP16 decode kernel", merged 2026-06).
# Upstream: tokenspeed-mla/python/tokenspeed_mla/mla_decode.py  tokenspeed_mla_decode(query, kv_cache, workspace_buffer,
# kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len, softmax_scale, ..., causal_mask=True) and the
# kernels in mla_decode_fp16.py (BlackwellMultiHeadLatentAttentionForwardFP16) / mla_decode_fp8.py.
# Bug: the BF16/FP16 MLA decode kernel only applied the K bound (col >= K) and never received is_causal (the wrapper
# wired causal_mask only into the FP8 kernel), so for q_len > 1 (MTP / speculative verify) every query row attended up
# to q_len - 1 later draft tokens already written to the paged cache.
# Fix: the FP16 kernel takes is_causal / seq_len_q and masks row r to cols < K - (q_len - 1 - r), like the FP8 kernel;
# the wrapper passes causal_mask to it.
#
# The CuTe DSL kernels are written here as plain-torch stand-ins with the same arguments and masking semantics.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BlackwellMultiHeadLatentAttentionForwardFP16:
    """Stand-in for the CuTe DSL BF16/FP16 MLA decode kernel (absorbed MLA: K = [c_latent, c_rope], V = c_latent)."""

    def __init__(self, kv_lora_rank, qk_rope_head_dim, page_size, is_causal=False, num_heads=None, seq_len_q=1):
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.page_size = page_size
        self.is_causal = is_causal
        self.num_heads = num_heads
        self.seq_len_q = seq_len_q

    def __call__(self, q_latent, q_rope, c_latent, c_rope, page_table, o, cache_seqs, softmax_scale, output_scale):
        B, q_len, H, _ = q_latent.shape
        for b in range(B):
            K = int(cache_seqs[b])
            n_pages = (K + self.page_size - 1) // self.page_size
            pages = page_table[b, :n_pages]
            ckv = c_latent[pages].reshape(-1, self.kv_lora_rank)  # [n_pages*page_size, D_ckv]
            kpe = c_rope[pages].reshape(-1, self.qk_rope_head_dim)
            n_cols = ckv.shape[0]
            s = torch.einsum("qhd,kd->qhk", q_latent[b], ckv) + torch.einsum("qhd,kd->qhk", q_rope[b], kpe)
            s = s * softmax_scale
            col = torch.arange(n_cols)
            row = torch.arange(q_len)
            if self.is_causal:
                # per-row MTP bound: row r sees cols < K - (seq_len_q - 1 - r)
                bound = K - (self.seq_len_q - 1 - row)
                masked = col[None, :] >= bound[:, None]
            else:
                masked = (col >= K)[None, :].expand(q_len, n_cols)
            s = s.masked_fill(masked[:, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1)
            o[b] = torch.einsum("qhk,kd->qhd", p, ckv) * output_scale
        return o


class BlackwellMultiHeadLatentAttentionForwardFP8(BlackwellMultiHeadLatentAttentionForwardFP16):
    """Stand-in for the FP8 kernel, which always implemented the MTP causal bound."""


def tokenspeed_mla_decode(query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
                          max_seq_len, softmax_scale, output_scale=1.0, out=None, is_var_seq=True, causal_mask=True,
                          enable_pdl=False):
    B, q_len, H, D_qk = query.shape
    page_size = kv_cache.shape[-2]
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if is_fp8:
        kernel_obj = BlackwellMultiHeadLatentAttentionForwardFP8(
            kv_lora_rank, qk_rope_head_dim, page_size, is_causal=causal_mask, num_heads=H, seq_len_q=q_len)
    elif FIXED:
        kernel_obj = BlackwellMultiHeadLatentAttentionForwardFP16(
            kv_lora_rank, qk_rope_head_dim, page_size, is_causal=causal_mask, num_heads=H, seq_len_q=q_len)
    else:
        kernel_obj = BlackwellMultiHeadLatentAttentionForwardFP16(kv_lora_rank, qk_rope_head_dim, page_size)
    q_latent = query[..., :kv_lora_rank]
    q_rope = query[..., kv_lora_rank:]
    c_latent = kv_cache[..., :kv_lora_rank]
    c_rope = kv_cache[..., kv_lora_rank:]
    if out is None:
        out = torch.empty(B, q_len, H, kv_lora_rank, dtype=query.dtype)
    return kernel_obj(q_latent.float(), q_rope.float(), c_latent.float(), c_rope.float(), block_tables, out,
                      seq_lens, softmax_scale, output_scale)


class DeepseekMLALayer(nn.Module):
    """Absorbed-weight MLA attention as the decode path runs it (tiny sizes)."""

    def __init__(self, hidden=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8):
        super().__init__()
        self.h, self.r, self.dn, self.dr, self.dv = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_proj = nn.Linear(hidden, num_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.w_kc = nn.Parameter(torch.randn(num_heads, qk_nope_head_dim, kv_lora_rank) * 0.3)
        self.w_vc = nn.Parameter(torch.randn(num_heads, kv_lora_rank, v_head_dim) * 0.3)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)

    def latent(self, x):
        return self.kv_a_proj(x)  # [..., r + dr] written to the paged cache

    def query(self, x):
        q = self.q_proj(x).view(*x.shape[:-1], self.h, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], q[..., self.dn:]
        q_nope_abs = torch.einsum("...hd,hdr->...hr", q_nope, self.w_kc)
        return torch.cat([q_nope_abs, q_pe], dim=-1)

    def out(self, attn_latent):
        o = torch.einsum("...hr,hrd->...hd", attn_latent, self.w_vc)
        return self.o_proj(o.flatten(-2))


def main():
    hidden, vocab, page_size, n_pages = 32, 50, 4, 16
    emb = nn.Embedding(vocab, hidden)
    layer = DeepseekMLALayer(hidden=hidden)
    lm_head = nn.Linear(hidden, vocab, bias=False)
    r, dr = layer.r, layer.dr
    kv_cache = torch.zeros(n_pages, page_size, r + dr, dtype=torch.bfloat16)
    workspace = torch.empty(0, dtype=torch.uint8)

    # two requests in a target-verify step: prefix already in cache, then 4 MTP draft tokens each
    prefix_lens = [6, 9]
    q_len = 4
    block_tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    with torch.no_grad():
        seqs = [torch.randint(0, vocab, (p + q_len,)) for p in prefix_lens]
        # fill the paged cache for prefix + draft tokens (the verify step writes its K before attention)
        for b, s in enumerate(seqs):
            lat = layer.latent(emb(s))
            for t in range(len(s)):
                kv_cache[block_tables[b, t // page_size], t % page_size] = lat[t]
        seq_lens = torch.tensor([p + q_len for p in prefix_lens], dtype=torch.int32)
        draft = torch.stack([s[-q_len:] for s in seqs])  # [B, q_len]
        query = layer.query(emb(draft))  # [B, q_len, H, r + dr]
        attn = tokenspeed_mla_decode(query, kv_cache, workspace, r, dr, block_tables.long(), seq_lens,
                                     int(seq_lens.max()), layer.scale, causal_mask=True)
        logits = lm_head(layer.out(attn) + emb(draft))
        pred = logits.argmax(-1)
    print("verify logits[0, :, :4]:", [[round(v, 4) for v in row] for row in logits[0, :, :4].tolist()])
    print("target argmax per draft position:", pred.tolist())
    print("logit checksum: %.6f" % float(logits.sum()))


if __name__ == "__main__":
    main()
