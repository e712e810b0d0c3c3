"""InternLM's SequenceGenerator on a left-padded batch: MHA's inference path ignores the attention mask.

Citation: InternLM/InternLM#396 ("fix(model): fix errant inference_forward", commit b3645b0):
internlm/model/multi_head_attention.py (MHA._forward, the inference_params branch), used by
internlm/apis/inference.py (SequenceGenerator -> greedy_generate -> _no_beam_search_generate).

_no_beam_search_generate builds a (bsz, L, L) boolean ``attention_mask`` (True = masked) from the bos
positions: a batch left-padded with extra bos tokens masks every row/column before the last bos of each
sample, and the mask is rebuilt for the whole sequence on every decode step and stored in
``inference_params.attention_mask``. The bug: MHA._forward's inference branch never reads it. Rotary is
applied at ``inference_params.sequence_len_offset`` for every row (the first real token of a padded row
sits at position n_pad, not 0), the prompt pass runs ``inner_cross_attn(q, kv, causal=None)`` (plain
causal) and the decode steps ``causal=False`` over the whole kv cache, so the padded rows attend to
their padding at every step.

The fix: when ``inference_params.attention_mask`` is set, the number of pads per row ("empties") is
read from the mask; on the prompt pass q/k are shifted left, rotated from position 0 and shifted back,
the padding is dropped (``~attn_mask[:, :, -1, :]``) and the real tokens go through
``flash_attn_unpadded_func`` with cu_seqlens; on decode steps q/k are rotated at
``sequence_len_offset - empties`` and the scores are ``masked_fill``-ed with the last row of the mask.

Toy sizes, random weights, CPU. Trimmed: tensor/sequence parallel linears are nn.Linear, the dynamic-NTK
rope branch is dropped, flash_attn's rotary kernels and CrossAttention are written in torch as
flash_attn defines them, and ``flash_attn_unpadded_func`` is a per-sequence causal softmax loop over
cu_seqlens (the CUDA kernel does not run on CPU); einops rearranges are written as unflatten/flatten.
"""

import math
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- flash_attn pieces (torch versions) -------------------------------------------------------------

def _rotate(x, cos, sin):
    # non-interleaved rotary on the first rotary_dim of the last axis; cos/sin: (seqlen, rotary_dim / 2)
    ro_dim = cos.shape[-1] * 2
    x_ro, x_pass = x[..., :ro_dim], x[..., ro_dim:]
    x1, x2 = x_ro.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x_pass], dim=-1)


def legacy_apply_rotary_embed_qkv(qkv, cos, sin):
    # qkv: (batch, seqlen, 3, nheads, headdim)
    seqlen = qkv.shape[1]
    cos = cos[:seqlen][:, None, :]
    sin = sin[:seqlen][:, None, :]
    q = _rotate(qkv[:, :, 0], cos, sin)
    k = _rotate(qkv[:, :, 1], cos, sin)
    return torch.stack([q, k, qkv[:, :, 2]], dim=2)


def legacy_apply_rotary_embed(x, cos, sin):
    # x: (batch, seqlen, nheads, headdim)
    seqlen = x.shape[1]
    return _rotate(x, cos[:seqlen][:, None, :], sin[:seqlen][:, None, :])


class CrossAttention(nn.Module):
    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        causal = self.causal if causal is None else causal
        batch_size, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = kv.shape[1]
        k, v = kv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if causal:
            row_idx = torch.arange(seqlen_q, device=q.device, dtype=torch.long)[:, None]
            col_idx = torch.arange(seqlen_k, device=kv.device, dtype=torch.long)
            causal_mask = col_idx > row_idx + seqlen_k - seqlen_q
            scores = scores.masked_fill(causal_mask, -10000.0)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        attention_drop = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention_drop, v)


def flash_attn_unpadded_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, return_attn_probs):
    # flash_attn varlen kvpacked: q (total, h, d), kv (total, 2, h, d); one causal softmax per sequence
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        s, e = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        ks, ke = cu_seqlens_k[i].item(), cu_seqlens_k[i + 1].item()
        out[s:e] = CrossAttention(causal=causal, softmax_scale=softmax_scale)(q[None, s:e], kv[None, ks:ke])[0]
    return out


def _update_kv_cache(kv, inference_params, layer_idx):
    """kv: (batch_size, seqlen, 2, nheads, head_dim) or (batch_size, 1, 2, nheads, head_dim)"""
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        kv_cache = torch.empty(
            inference_params.max_batch_size, inference_params.max_sequence_len, 2, num_heads, head_dim,
            dtype=kv.dtype, device=kv.device,
        )
        inference_params.key_value_memory_dict[layer_idx] = kv_cache
    else:
        kv_cache = inference_params.key_value_memory_dict[layer_idx]
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.sequence_len_offset
    sequence_end = sequence_start + kv.shape[1]
    kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
    kv = kv_cache[batch_start:batch_end, :sequence_end, ...]
    return kv


# ---- internlm/model/embedding.py --------------------------------------------------------------------

class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim: int, base=10000, scale_base=0, device=None):
        super().__init__()
        self.dim = dim
        self.base = base
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        self.scale_base = scale_base
        self.scale = None
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, x, indexes):
        if not isinstance(indexes, int):
            seqlen = indexes.max().item() + 1
        else:
            seqlen = indexes + 1  # eval_forward
        if seqlen > self._seq_len_cached or self._cos_cached.device != x.device or self._cos_cached.dtype != x.dtype:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=x.device, dtype=self.inv_freq.dtype)
            freqs = torch.outer(t, self.inv_freq.to(device=t.device))
            self._cos_cached = torch.cos(freqs).to(x.dtype)
            self._sin_cached = torch.sin(freqs).to(x.dtype)

    def forward(self, qkv: torch.Tensor, **kwargs):
        if kwargs.get("inference_params", None) is not None:
            return self._eval_forward(qkv, seqlen_offset=kwargs.get("inference_params", None).sequence_len_offset)
        else:
            return self._eval_forward(qkv)

    def _eval_forward(self, qkv, seqlen_offset=0):
        self._update_cos_sin_cache(qkv, seqlen_offset + qkv.shape[1])
        return legacy_apply_rotary_embed_qkv(qkv, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:])

    def _single_forward(self, x, indexes=0):
        assert self.scale is None
        self._update_cos_sin_cache(x, indexes)
        x = x[None, ...]
        ret = legacy_apply_rotary_embed(x, self._cos_cached[indexes], self._sin_cached[indexes]).squeeze(0)
        return ret

    def _single_eval_forward(self, x, seqlen_offset=0):
        assert self.scale is None
        self._update_cos_sin_cache(x, seqlen_offset + x.shape[1])
        return legacy_apply_rotary_embed(x, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:])


# ---- internlm/model/multi_head_attention.py ---------------------------------------------------------

class MHA(nn.Module):
    def __init__(self, embed_dim, num_heads, max_position_embeddings=2048, dropout=0.0, softmax_scale=None,
                 causal=False, layer_idx=None, use_dynamic_ntk_rope=False, rotary_emb_dim=0):
        super().__init__()
        self.embed_dim = embed_dim
        self.causal = causal
        self.layer_idx = layer_idx
        self.max_position_embeddings = max_position_embeddings
        self.use_dynamic_ntk_rope = use_dynamic_ntk_rope
        self.rotary_emb_dim = rotary_emb_dim
        self.num_heads = num_heads
        self.head_dim = self.embed_dim // num_heads
        if self.rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(self.rotary_emb_dim)
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=True)
        self.inner_cross_attn = CrossAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, seqlen=None, inference_params=None, **kwargs):
        return self._forward(x=x, seqlen=seqlen, inference_params=inference_params, **kwargs)

    def _forward(self, x, seqlen=None, inference_params=None, **kwargs):
        bsz, _, _ = x.shape
        qkv = self.Wqkv(x)
        qkv = qkv.unflatten(-1, (3, -1, self.head_dim))  # "b s (three h d) -> b s three h d"

        if not FIXED:
            if self.rotary_emb_dim > 0:
                kwargs["inference_params"] = inference_params
                qkv = self.rotary_emb(qkv, **kwargs)
            q = qkv[:, :, 0]
            assert self.layer_idx is not None, "Generation requires layer_idx in the constructor"
            kv = _update_kv_cache(qkv[:, :, 1:], inference_params, self.layer_idx)

            # If we're processing the prompt, causal=None (use self.causal).
            # If we're decoding, then causal=False.
            causal = None if inference_params.sequence_len_offset == 0 else False
            context = self.inner_cross_attn(q, kv, causal=causal)
        else:
            assert self.layer_idx is not None, "Generation requires layer_idx in the constructor"
            q, k, v = (x.squeeze(2) for x in qkv.chunk(chunks=3, dim=2))
            kv = torch.stack([k, v], dim=2)
            assert self.rotary_emb_dim > 0, "You should use rotary_emb."

            if hasattr(inference_params, "attention_mask") and inference_params.attention_mask is not None:
                empties = inference_params.attention_mask[..., -1].sum(dim=-1)
                if inference_params.sequence_len_offset == 0:
                    moved_q = q.clone()
                    moved_k = k.clone()
                    for i in range(len(empties)):
                        if empties[i] != 0:
                            moved_q[i][: -empties[i]] = q[i][empties[i] :]
                            moved_k[i][: -empties[i]] = k[i][empties[i] :]
                    moved_q = self.rotary_emb._single_eval_forward(moved_q, seqlen_offset=0)
                    moved_k = self.rotary_emb._single_eval_forward(moved_k, seqlen_offset=0)
                    for i in range(len(empties)):
                        if empties[i] != 0:
                            q[i][empties[i] :] = moved_q[i][: -empties[i]]
                            k[i][empties[i] :] = moved_k[i][: -empties[i]]
                        else:
                            q[i] = moved_q[i]
                            k[i] = moved_k[i]
                else:
                    if inference_params.sequence_len_offset > self.max_position_embeddings:
                        warnings.warn("Notice your prompt's length is longer than model's max_position_embeddings")
                    q = q.squeeze(1)
                    k = k.squeeze(1)
                    q = self.rotary_emb._single_forward(
                        q,
                        inference_params.sequence_len_offset * torch.ones(q.size(0), dtype=torch.int, device=q.device)
                        - empties,
                    ).unsqueeze(1)
                    k = self.rotary_emb._single_forward(
                        k,
                        inference_params.sequence_len_offset * torch.ones(k.size(0), dtype=torch.int, device=k.device)
                        - empties,
                    ).unsqueeze(1)
            else:
                q = self.rotary_emb._single_forward(q, inference_params.sequence_len_offset)
                k = self.rotary_emb._single_forward(k, inference_params.sequence_len_offset)

            kv = torch.stack([k, v], dim=2)
            kv = _update_kv_cache(kv, inference_params, self.layer_idx)

            if hasattr(inference_params, "attention_mask") and inference_params.attention_mask is not None:
                if inference_params.sequence_len_offset == 0:  # First entrance, attnmask (bs*seqlen*seqlen)
                    attn_mask = inference_params.attention_mask[:, None, ...]
                    attn_mask = torch.logical_or(torch.ones_like(attn_mask, dtype=torch.bool).triu(diagonal=1), attn_mask)
                    attn_mask4flsh = ~attn_mask[:, :, -1, :].view(bsz, -1)
                    cu_seqlens = torch.concat(
                        [
                            torch.tensor([0], dtype=torch.int32, device=attn_mask4flsh.device),
                            attn_mask4flsh.sum(dim=-1).to(dtype=torch.int32),
                        ],
                        dim=0,
                    )
                    cu_seqlens = cu_seqlens.cumsum(dim=0, dtype=torch.int32)
                    max_seqlen_q = attn_mask4flsh.shape[-1]
                    max_seqlen_k = attn_mask4flsh.shape[-1]
                    total_q = q.masked_select(attn_mask4flsh.view(bsz, -1, 1, 1)).view(-1, q.shape[-2], q.shape[-1])
                    total_kv = kv.masked_select(attn_mask4flsh.view(bsz, -1, 1, 1, 1)).view(
                        -1, kv.shape[-3], kv.shape[-2], kv.shape[-1]
                    )
                    output = flash_attn_unpadded_func(
                        total_q, total_kv, cu_seqlens, cu_seqlens, max_seqlen_q, max_seqlen_k, 0.0, None, True, False
                    ).to(x.dtype)
                    context = torch.zeros_like(q)
                    context = context.masked_scatter_(attn_mask4flsh.view(bsz, -1, 1, 1), output)
                else:
                    attn_mask = inference_params.attention_mask[:, -1, :].view(bsz, 1, 1, -1)
                    k, v = torch.chunk(kv, 2, dim=2)
                    k = k.squeeze(2)
                    v = v.squeeze(2)
                    sp = k.shape
                    scores = torch.einsum(
                        "blhd,bnhd->bhln", q, k.reshape(sp[0], sp[1], q.size(2), sp[3]),
                    ) / math.sqrt(q.size(-1))
                    scores = scores.masked_fill(attn_mask, -65000.0)
                    scores = F.softmax(scores, dim=-1)  # bsz x h x L x L
                    context = torch.einsum("bhmn,bnhd->bmhd", scores, v.reshape(sp[0], sp[1], q.size(2), sp[3]))
            else:
                context = self.inner_cross_attn(q, kv, causal=True)

        context = context.flatten(2)  # "b s h d -> b s (h d)"
        out = self.out_proj(context)
        return out


# ---- internlm/model/modeling_internlm.py (trimmed) --------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class FeedForward(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.w1 = nn.Linear(in_features, hidden_features, bias=False)
        self.w2 = nn.Linear(in_features, hidden_features, bias=False)
        self.w3 = nn.Linear(hidden_features, in_features, bias=False)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class PackedFlashBaseLayer1D(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, mlp_ratio, layer_idx, max_position_embeddings):
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        self.mixer = MHA(
            embed_dim=hidden_size, num_heads=num_attention_heads, max_position_embeddings=max_position_embeddings,
            causal=True, layer_idx=layer_idx, rotary_emb_dim=head_dim,
        )
        self.norm1 = RMSNorm(hidden_size)
        self.norm2 = RMSNorm(hidden_size)
        self.mlp = FeedForward(hidden_size, int(hidden_size * mlp_ratio))

    def forward(self, hidden_states, inference_params=None):
        residual = hidden_states
        hidden_states = self.norm1(residual.float())
        hidden_states = self.mixer(hidden_states, inference_params=inference_params)
        residual = hidden_states + residual
        hidden_states = self.norm2(residual.float())
        hidden_states = self.mlp(hidden_states)
        return hidden_states + residual


class PackedFlashInternLm1D(nn.Module):
    def __init__(self, num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, mlp_ratio=2.0,
                 max_position_embeddings=2048):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            [PackedFlashBaseLayer1D(hidden_size, num_attention_heads, mlp_ratio, lid, max_position_embeddings)
             for lid in range(num_layers)]
        )
        self.norm = RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids=None, inference_params=None):
        hidden_states = self.embedding(input_ids)
        for _, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, inference_params=inference_params)
        hidden_states = self.norm(hidden_states.float())
        hidden_states = self.head(hidden_states)
        return hidden_states


# ---- internlm/apis/inference.py (greedy path) -------------------------------------------------------

class InferenceParams:
    def __init__(self, max_sequence_len, max_batch_size, sequence_len_offset=0, batch_size_offset=0,
                 key_value_memory_dict: dict = None, lengths_per_sample=None, attention_mask=None) -> None:
        self.max_sequence_len: int = max_sequence_len
        self.max_batch_size: int = max_batch_size
        self.sequence_len_offset: int = sequence_len_offset
        self.batch_size_offset: int = batch_size_offset
        if key_value_memory_dict is None:
            key_value_memory_dict = {}
        self.key_value_memory_dict: dict = key_value_memory_dict
        self.fused_ft_kernel: bool = False
        self.lengths_per_sample = lengths_per_sample
        self.attention_mask = attention_mask


class SequenceGenerator:
    def __init__(self, decoder, eos_token_id, pad_token_id, bos_token_id):
        self.decoder = decoder
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id

    @torch.no_grad()
    def generate(self, tokens, max_length=20, do_sample=False):
        return _no_beam_search_generate(
            self.decoder, tokens=tokens, max_length=max_length, eos_token_id=self.eos_token_id,
            do_sample=do_sample, pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id,
        )


def _bos_attention_mask(token_ids, bos_token_id, has_bos):
    if has_bos:
        bos_pos = torch.where(token_ids.eq(bos_token_id), 1, 0)
        bos_sum = bos_pos.cumsum(dim=-1)
        bos_pos = torch.where(bos_sum.eq(bos_sum[:, -1:]), 0, 1)
        to_atten_x = bos_pos[:, :, None]
        to_atten_y = bos_pos[:, None, :]
    else:
        bos_pos = torch.where(token_ids.eq(bos_token_id), 1, 0)
        to_atten_x = bos_pos[:, :, None]
        to_atten_y = bos_pos[:, None, :]
    return torch.logical_or(to_atten_x, to_atten_y).eq(1)


@torch.no_grad()
def _no_beam_search_generate(decoder, tokens, inference_params=None, max_length=20, eos_token_id=None,
                             do_sample=False, pad_token_id=0, bos_token_id=1):
    batch_size = tokens.size(0)
    _eos_token_id = -1 if eos_token_id is None else eos_token_id

    has_bos = torch.all(tokens[:, 0].eq(bos_token_id))
    attention_mask = _bos_attention_mask(tokens, bos_token_id, has_bos)
    if inference_params is None:
        inference_params = InferenceParams(
            max_sequence_len=max_length, max_batch_size=tokens.size(0), sequence_len_offset=0,
            batch_size_offset=0, key_value_memory_dict=None, lengths_per_sample=None, attention_mask=attention_mask,
        )

    scores = decoder(**{"input_ids": tokens, "inference_params": inference_params})
    scores = scores[:, -1].float()
    inference_params.sequence_len_offset += tokens.size(1)
    if _eos_token_id != -1:
        scores[:, _eos_token_id] = -1e12
    next_tokens = scores.argmax(dim=-1, keepdim=True)
    token_ids = torch.cat([tokens, next_tokens], dim=1)
    cur_len = token_ids.size(1)
    dones = token_ids.new_zeros(batch_size).eq(1)
    all_scores = [scores]

    real_max_length = max_length
    max_lengths = tokens.new_full((tokens.size(0),), fill_value=max_length, dtype=torch.long)

    while cur_len < real_max_length:
        attention_mask = _bos_attention_mask(token_ids, bos_token_id, has_bos)
        inference_params.attention_mask = attention_mask
        scores = decoder(**{"input_ids": token_ids[:, -1:], "inference_params": inference_params})
        scores = scores[:, -1].float()
        inference_params.sequence_len_offset += 1
        all_scores.append(scores)

        next_tokens = torch.argmax(scores, dim=-1)  # batch_size
        if _eos_token_id != -1:
            next_tokens = next_tokens.masked_fill(max_lengths.eq(cur_len + 1), _eos_token_id)
        next_tokens = next_tokens.masked_fill(dones, pad_token_id)
        tokens = next_tokens.unsqueeze(1)
        token_ids = torch.cat([token_ids, tokens], dim=-1)  # batch_size x max_len
        end_mask = next_tokens.eq(_eos_token_id)
        dones = dones.__or__(end_mask)
        cur_len += 1
        if dones.min() == 1:
            break
    return token_ids[:, None], torch.stack(all_scores, dim=1)


def main():
    torch.manual_seed(0)
    bos_token_id, eos_token_id = 1, 2
    model = PackedFlashInternLm1D(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128).eval()
    generator = SequenceGenerator(model, eos_token_id=eos_token_id, pad_token_id=eos_token_id, bos_token_id=bos_token_id)

    # input_ids = [bos] + tokenizer.encode(prompt); the shorter prompt is left-padded with extra bos tokens
    prompts = [[bos_token_id, 17, 43, 88, 9], [bos_token_id, 23, 54, 71, 12, 99, 31, 66, 40]]
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[bos_token_id] * (width - len(p)) + p for p in prompts])

    out, scores = generator.generate(tokens, max_length=width + 6, do_sample=False)
    for i in range(len(prompts)):
        print(f"sample {i}: generated {out[i, 0, width:].tolist()}  first-step logit max {scores[i, 0].max().item():.4f}")


if __name__ == "__main__":
    main()
