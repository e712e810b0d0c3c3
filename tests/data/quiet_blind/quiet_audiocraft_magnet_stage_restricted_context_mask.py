"""MAGNeT (audiocraft) per-stage self-attention masks, ported small.

Follows facebookresearch/audiocraft @123aa8d0c6ff54d8c875a9eadded6a8e8f00ff84:
  audiocraft/models/lm_magnet.py   MagnetLMModel.restricted_context_attn_mask,
                                   _stage_attn_mask (repeat per head, align8 buffer),
                                   _build_attn_masks (one entry per RVQ stage, built for
                                   framerate * segment_duration), _generate_magnet /
                                   _generate_stage (span masking, CFG by doubling batch)
  audiocraft/models/lm.py          LMModel.forward(..., stage): src_mask=attn_mask_per_stage[stage]
  audiocraft/modules/transformer.py (HEAD 896ec7c) StreamingMultiheadAttention.forward,
                                   memory_efficient + custom_attn_mask branch:
                                   attn_mask.repeat((B,1,1,1))[..., :seq_len, :seq_len]
                                   then xformers memory_efficient_attention(q, k, v, attn_mask)
                                   (MAGNeT loaders force the xformers backend, layout b t h d).

xformers.ops.memory_efficient_attention is replaced by a plain torch stand-in with the
same semantics (additive bias on the scores, layout [B, M, H, K]).

Stage 0 (first codebook) attends the whole sequence (no mask, non-causal); stages > 0
attend only |q - k| <= subcodes_context. The mask is built once for the training length
and sliced to the generation length. Checked against a per-query loop that slices the
allowed keys explicitly (no mask), and by running the whole MAGNeT decoding with both.
"""
import math
import typing as tp

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---- stand-in for xformers.ops.memory_efficient_attention (layout [B, M, H, K]) ----
def memory_efficient_attention(q, k, v, attn_bias=None, p=0.0):
    scale = q.shape[-1] ** -0.5
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # B H M K
    scores = torch.matmul(qh * scale, kh.transpose(-1, -2))
    if attn_bias is not None:
        scores = scores + attn_bias
    w = torch.softmax(scores, dim=-1)
    return torch.matmul(w, vh).transpose(1, 2)


def create_sin_embedding(positions, dim, max_period=10000.0):
    half_dim = dim // 2
    adim = torch.arange(half_dim, device=positions.device, dtype=torch.float32).view(1, 1, -1)
    phase = positions / (max_period ** (adim / (half_dim - 1)))
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)


class StreamingMultiheadAttention(nn.Module):
    """custom=True, memory_efficient=True, xformers backend (time_dim = 1)."""

    def __init__(self, embed_dim, num_heads, cross_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.cross_attention = cross_attention
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / math.sqrt(embed_dim))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.02)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None, reference=False, ref_context=None):
        custom_attn_mask = attn_mask is not None
        B, T, _ = query.shape
        H = self.num_heads
        if self.cross_attention:
            dim = self.in_proj_weight.shape[0] // 3
            q = F.linear(query, self.in_proj_weight[:dim], self.in_proj_bias[:dim])
            k = F.linear(key, self.in_proj_weight[dim:2 * dim], self.in_proj_bias[dim:2 * dim])
            v = F.linear(value, self.in_proj_weight[2 * dim:], self.in_proj_bias[2 * dim:])
            q, k, v = [x.reshape(x.shape[0], x.shape[1], H, -1) for x in (q, k, v)]
        else:
            assert query is key and value is key
            projected = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            packed = projected.reshape(B, T, 3, H, -1)  # "b t (p h d) -> b t p h d"
            q, k, v = packed.unbind(dim=2)

        if reference:
            out = reference_attention(q, k, v, ref_context)
        else:
            if custom_attn_mask:
                # Move to query's device, repeat for each sample, remove align8 padding
                seq_len = query.shape[1]
                attn_mask = attn_mask.to(q.dtype)
                attn_mask = attn_mask.repeat((q.shape[0], 1, 1, 1))
                attn_mask = attn_mask[..., :seq_len, :seq_len]
            out = memory_efficient_attention(q, k, v, attn_mask, p=0.0)
        out = out.reshape(B, T, -1)
        return self.out_proj(out), None


def reference_attention(q, k, v, context):
    """Independent reference: per query position, slice the keys it may see."""
    B, T, H, D = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        if context is None:
            lo, hi = 0, k.shape[1]
        else:
            lo, hi = max(0, t - context), min(k.shape[1], t + context + 1)
        s = torch.einsum("bhd,bshd->bhs", q[:, t] * D ** -0.5, k[:, lo:hi])
        w = torch.softmax(s, dim=-1)
        out[:, t] = torch.einsum("bhs,bshd->bhd", w, v[:, lo:hi])
    return out


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model, num_heads, dim_ff):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads)
        self.cross_attention = StreamingMultiheadAttention(d_model, num_heads, cross_attention=True)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm_cross = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_ff)
        self.linear2 = nn.Linear(dim_ff, d_model)

    def forward(self, src, src_mask=None, cross_attention_src=None, reference=False, ref_context=None):
        x = src
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, attn_mask=src_mask, reference=reference, ref_context=ref_context)[0]
        x = x + self.cross_attention(self.norm_cross(x), cross_attention_src, cross_attention_src,
                                     reference=reference, ref_context=None)[0]
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x


class StreamingTransformer(nn.Module):
    def __init__(self, d_model, num_heads, num_layers, dim_ff):
        super().__init__()
        self.layers = nn.ModuleList([StreamingTransformerLayer(d_model, num_heads, dim_ff)
                                     for _ in range(num_layers)])

    def forward(self, x, cross_attention_src=None, src_mask=None, reference=False, ref_context=None):
        B, T, C = x.shape
        positions = torch.arange(T, device=x.device).view(1, -1, 1)
        x = x + create_sin_embedding(positions, C)
        for layer in self.layers:
            x = layer(x, src_mask=src_mask, cross_attention_src=cross_attention_src,
                      reference=reference, ref_context=ref_context)
        return x


class MagnetLMModel(nn.Module):
    def __init__(self, n_q=3, card=16, dim=32, num_heads=4, num_layers=2,
                 subcodes_context=2, compression_model_framerate=5, segment_duration=4, span_len=2,
                 device=torch.device("cpu"), dtype=torch.float32):
        super().__init__()
        self.n_q = self.num_codebooks = n_q
        self.card = card
        self.special_token_id = card
        self.emb = nn.ModuleList([nn.Embedding(card + 1, dim) for _ in range(n_q)])
        self.transformer = StreamingTransformer(dim, num_heads, num_layers, 2 * dim)
        self.out_norm = nn.LayerNorm(dim)
        self.linears = nn.ModuleList([nn.Linear(dim, card) for _ in range(n_q)])
        self.subcodes_context = subcodes_context
        self.span_len = span_len
        self.use_reference = False
        self._build_attn_masks(compression_model_framerate=compression_model_framerate,
                               segment_duration=segment_duration, num_heads=num_heads,
                               device=device, dtype=dtype)

    def restricted_context_attn_mask(self, seq_len, device, dtype):
        # Return a context restricted non-causal att mask
        queries_pos = torch.arange(seq_len, device=device).view(-1, 1)
        keys_pos = torch.arange(seq_len, device=device).view(1, -1)
        delta = queries_pos - keys_pos
        valid = torch.abs(delta) <= self.subcodes_context
        return torch.where(
            valid,
            torch.zeros([], device=device, dtype=dtype),
            torch.full([], float('-inf'), device=device, dtype=dtype))

    def _stage_attn_mask(self, stage, seq_len, num_heads, device, dtype):
        sa_mask = None
        if stage > 0 and self.subcodes_context > -1:
            # parallel - non-causal - with restricted subcodes context
            sa_mask = self.restricted_context_attn_mask(seq_len, device=device, dtype=dtype)
        if sa_mask is not None:
            # Repeat for each attention head
            sa_mask = sa_mask.repeat((1, num_heads, 1, 1))
            # align8 to enable memory efficient attention
            MEMORY_EFFICIENT_ATTN_ALIGN_FACTOR = 8
            seq_len_aligned = \
                int(np.ceil(seq_len / MEMORY_EFFICIENT_ATTN_ALIGN_FACTOR)) * MEMORY_EFFICIENT_ATTN_ALIGN_FACTOR
            sa_mask_aligned = torch.zeros((1, num_heads, seq_len_aligned, seq_len_aligned), device=device, dtype=dtype)
            sa_mask_aligned[..., :seq_len, :seq_len] = sa_mask
            sa_mask = sa_mask_aligned
        return sa_mask

    def _build_attn_masks(self, compression_model_framerate, segment_duration, num_heads, device, dtype):
        seq_len = compression_model_framerate * segment_duration
        self.attn_mask_per_stage = [self._stage_attn_mask(stage, seq_len, num_heads, device, dtype)
                                    for stage in range(self.n_q)]

    def forward(self, sequence, condition_tensors, stage=-1):
        B, K, S = sequence.shape
        assert K == self.num_codebooks
        input_ = sum([self.emb[k](sequence[:, k]) for k in range(K)])
        cross_attention_input = condition_tensors["description"]
        if self.use_reference:
            ctx = self.subcodes_context if (stage > 0 and self.subcodes_context > -1) else None
            out = self.transformer(input_, cross_attention_src=cross_attention_input,
                                   reference=True, ref_context=ctx)
        else:
            out = self.transformer(input_, cross_attention_src=cross_attention_input,
                                   src_mask=(self.attn_mask_per_stage[stage] if stage >= 0 else None))
        out = self.out_norm(out)
        logits = torch.stack([self.linears[k](out) for k in range(K)], dim=1)  # [B, K, S, card]
        return logits

    # ---- MAGNeT iterative decoding (greedy, nonoverlap spans, 'max' span scoring) ----
    @torch.no_grad()
    def generate(self, cfg_conditions, num_samples, max_gen_len, decoding_steps,
                 max_cfg_coef=10.0, min_cfg_coef=1.0):
        B, K = num_samples, self.num_codebooks
        gen_sequence = torch.full((B, K, max_gen_len), self.special_token_id, dtype=torch.long)
        for stage, n_steps in zip(range(self.n_q), decoding_steps):
            gen_sequence = self._generate_stage(gen_sequence, cfg_conditions, stage, n_steps,
                                                max_cfg_coef, min_cfg_coef)
        return gen_sequence

    def _generate_stage(self, gen_sequence, condition_tensors, stage, timesteps, max_cfg_coef, min_cfg_coef):
        B, K, T = gen_sequence.shape
        shape = (B, 1, T)
        mask_id = self.special_token_id
        stage_gen_seq = torch.full(shape, mask_id, dtype=torch.long)
        DONT_REMASK_ME_SCORE = -1e4
        n_chunks = T // self.span_len
        if T % self.span_len != 0:
            # trim sequence ending to achieve a multiple of span_len
            T = self.span_len * n_chunks
            gen_sequence = gen_sequence[..., :T]
            stage_gen_seq = stage_gen_seq[..., :T]
        chunked_shape = (B, 1, n_chunks)
        scores = torch.zeros(chunked_shape, dtype=torch.float32)
        num_chunks_to_gen = n_chunks
        for timestep, steps_left in zip(torch.linspace(0, 1, timesteps), reversed(range(timesteps))):
            mask_p = torch.cos(timestep * math.pi * 0.5)
            num_masked = max(int((mask_p * num_chunks_to_gen).item()), 1)
            masked = scores.topk(num_masked, dim=-1).indices
            chunks_mask = torch.full(chunked_shape, False, dtype=torch.bool)
            chunks_mask = chunks_mask.scatter(2, masked, True)
            mask = torch.repeat_interleave(chunks_mask, self.span_len, dim=-1)
            stage_gen_seq[mask] = mask_id
            gen_sequence[:, [stage], :] = stage_gen_seq
            # duplicate input for classifier free guidance
            sequence = torch.cat([gen_sequence, gen_sequence], dim=0)
            all_logits = self(sequence, condition_tensors, stage=stage)
            cond_logits, uncond_logits = all_logits.split(B, dim=0)
            clsfg_coef = float(mask_p) * max_cfg_coef + (1 - float(mask_p)) * min_cfg_coef
            logits = uncond_logits + (cond_logits - uncond_logits) * clsfg_coef
            logits = logits[:, stage, :, :].unsqueeze(1)
            probs = torch.softmax(logits, dim=-1)
            sampled_tokens = torch.argmax(logits, dim=-1, keepdim=True)
            mask = stage_gen_seq == mask_id
            stage_gen_seq = torch.where(mask, sampled_tokens[..., 0], stage_gen_seq)
            gen_sequence[:, [stage], :] = stage_gen_seq
            sampled_probs = torch.gather(probs, 3, sampled_tokens)[..., 0]
            scores = 1 - torch.max(sampled_probs.reshape((B, 1, n_chunks, -1)), dim=-1)[0]
            scores = scores.masked_fill(~chunks_mask, DONT_REMASK_ME_SCORE)
        return gen_sequence


def main():
    model = MagnetLMModel().eval()
    B, L_cond, dim = 2, 5, 32
    # conditional rows, then the null condition (all-zero embeddings, same length: nothing padded)
    desc = torch.randn(B, L_cond, dim)
    cfg_conditions = {"description": torch.cat([desc, torch.zeros_like(desc)], dim=0)}

    ok = True
    # mask sanity: built at 20 steps, aligned to 24; sliced to 12 equals the mask built at 12
    m = model.attn_mask_per_stage[1]
    assert model.attn_mask_per_stage[0] is None and tuple(m.shape) == (1, 4, 24, 24)
    direct = model.restricted_context_attn_mask(12, torch.device("cpu"), torch.float32)
    ok &= torch.equal(m[0, 0, :12, :12], direct)

    # per-stage logits vs the per-query reference
    with torch.no_grad():
        for T in (12, 20, 7):
            seq = torch.randint(0, model.card + 1, (2 * B, model.n_q, T))
            for stage in range(model.n_q):
                model.use_reference = False
                a = model(seq, cfg_conditions, stage=stage)
                model.use_reference = True
                b = model(seq, cfg_conditions, stage=stage)
                match = torch.allclose(a, b, atol=1e-5)
                print(f"T={T:2d} stage={stage} logits match reference: {match}")
                ok &= match
        model.use_reference = False

    # whole MAGNeT decoding, masked vs reference
    model.use_reference = False
    out = model.generate(cfg_conditions, B, max_gen_len=13, decoding_steps=[4, 2, 2])
    model.use_reference = True
    ref = model.generate(cfg_conditions, B, max_gen_len=13, decoding_steps=[4, 2, 2])
    model.use_reference = False
    gen_match = torch.equal(out, ref) and bool((out != model.special_token_id).all())
    print("generated codes shape", tuple(out.shape), "match reference:", gen_match)
    ok &= gen_match
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
