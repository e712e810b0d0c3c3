"""MPT prefix-LM (mosaicml/llm-foundry) with full (symmetric) ALiBi, torch attn_impl.

Ported from mosaicml/llm-foundry:
  llmfoundry/models/mpt/modeling_mpt.py @0085285a957badb20c34a462551d25aa5c0a5fc1
      MPTModel._attn_bias, MPTModel._apply_prefix_mask, MPTModel.forward,
      MPTForCausalLM.prepare_inputs_for_generation (prefix_mask = ones_like(attention_mask))
  llmfoundry/models/layers/attention.py @00ef82a3f8fc6cd4b05f1830bda4b22e3d4f6a40
      scaled_multihead_dot_product_attention, attn_bias_shape, build_attn_bias,
      gen_slopes, build_alibi_bias

Two uses, as the repo runs them:
  * training forward (ComposerMPTCausalLM.forward): RIGHT-padded batch, the prompt marked by
    `bidirectional_mask` (passed as prefix_mask), attention_mask for padding;
  * greedy generation with the KV cache from LEFT-padded prompts: prefill with
    prefix_mask = ones (the whole prompt sees itself both ways), then one token per step,
    each new token sees every cached key (which is exactly "causal after the prefix").

The checks compare against each sequence run alone, unpadded, with attention written as a
loop over query positions (allowed keys: j <= i or j < prefix_len; bias -slope*|i-j|).
"""
import math

import torch
import torch.nn as nn

torch.manual_seed(0)

VOCAB = 37
D_MODEL = 32
N_HEADS = 4
N_LAYERS = 2
MAX_SEQ_LEN = 16
ALIBI_BIAS_MAX = 8


# ----------------------------------------------------------------------------
# llmfoundry/models/layers/attention.py
# ----------------------------------------------------------------------------
def scaled_multihead_dot_product_attention(query, key, value, n_heads, kv_n_heads,
                                           past_key_value=None, softmax_scale=None,
                                           attn_bias=None, key_padding_mask=None,
                                           is_causal=False):
    b, s_q_, _ = query.shape
    q = query.view(b, s_q_, n_heads, -1).permute(0, 2, 1, 3)           # b h s d
    k = key.view(b, key.shape[1], kv_n_heads, -1).permute(0, 2, 3, 1)   # b h d s
    v = value.view(b, value.shape[1], kv_n_heads, -1).permute(0, 2, 1, 3)

    if past_key_value is not None:
        # torch attn_impl keeps keys as [b, h, d_head, s] and values as [b, h, s, d_head]
        if len(past_key_value) != 0:
            k = torch.cat([past_key_value[0], k], dim=3)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v)

    b, _, s_q, d = q.shape
    s_k = k.size(-1)

    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)

    attn_weight = q.matmul(k) * softmax_scale

    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        if (attn_bias.size(-1) != 1 and attn_bias.size(-1) != s_k) or (
                attn_bias.size(-2) != 1 and attn_bias.size(-2) != s_q):
            raise RuntimeError(f'attn_bias (shape: {attn_bias.shape}) does not broadcast to {attn_weight.shape}.')
        attn_weight = attn_weight + attn_bias

    min_val = torch.finfo(q.dtype).min

    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)

    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)

    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.to(v.dtype).matmul(v)
    out = out.permute(0, 2, 1, 3).reshape(b, s_q, -1)
    return out, None, past_key_value


def attn_bias_shape(attn_impl, n_heads, seq_len, alibi, prefix_lm, causal, use_sequence_id):
    if attn_impl == 'flash':
        return None
    if alibi:
        if (prefix_lm or not causal) or use_sequence_id:
            return (1, n_heads, seq_len, seq_len)
        return (1, n_heads, 1, seq_len)
    elif prefix_lm or use_sequence_id:
        return (1, 1, seq_len, seq_len)
    return None


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = (1. / torch.pow(2, m))
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, 1, seq_len)
    if full:
        # 1 x Heads x SeqLen x SeqLen: -|i - j|
        alibi_bias = alibi_bias - torch.arange(1 - seq_len, 1, dtype=torch.int32,
                                               device=device).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def build_attn_bias(attn_impl, attn_bias, n_heads, seq_len, causal=False, alibi=False, alibi_bias_max=8):
    if alibi:
        attn_bias = attn_bias.add(build_alibi_bias(n_heads, seq_len, full=not causal,
                                                   alibi_bias_max=alibi_bias_max,
                                                   device=attn_bias.device, dtype=attn_bias.dtype))
    return attn_bias


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.kv_n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True):
        qkv = self.Wqkv(x)
        query, key, value = qkv.split([self.d_model, self.d_model, self.d_model], dim=2)
        key_padding_mask = attention_mask
        context, _, past_key_value = scaled_multihead_dot_product_attention(
            query, key, value, self.n_heads, self.kv_n_heads,
            past_key_value=past_key_value, attn_bias=attn_bias,
            key_padding_mask=key_padding_mask, is_causal=is_causal)
        return self.out_proj(context), past_key_value


class MPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1 = nn.LayerNorm(D_MODEL)
        self.attn = MultiheadAttention(D_MODEL, N_HEADS)
        self.norm_2 = nn.LayerNorm(D_MODEL)
        self.ffn = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True):
        a = self.norm_1(x)
        b, past_key_value = self.attn(a, past_key_value=past_key_value, attn_bias=attn_bias,
                                      attention_mask=attention_mask, is_causal=is_causal)
        x = x + b
        m = self.norm_2(x)
        x = x + self.ffn(m)
        return x, past_key_value


# ----------------------------------------------------------------------------
# llmfoundry/models/mpt/modeling_mpt.py
# ----------------------------------------------------------------------------
class MPTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_impl = 'torch'
        self.prefix_lm = True
        self.attn_uses_sequence_id = False
        self.alibi = True
        self.alibi_bias_max = ALIBI_BIAS_MAX
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList([MPTBlock() for _ in range(N_LAYERS)])
        self.norm_f = nn.LayerNorm(D_MODEL)
        self.is_causal = not self.prefix_lm
        self._attn_bias_initialized = False
        self.attn_bias = None
        self.attn_bias_shape = attn_bias_shape(self.attn_impl, N_HEADS, MAX_SEQ_LEN, self.alibi,
                                               prefix_lm=self.prefix_lm, causal=self.is_causal,
                                               use_sequence_id=self.attn_uses_sequence_id)

    @torch.no_grad()
    def _attn_bias(self, device, dtype, attention_mask=None, prefix_mask=None):
        if not self._attn_bias_initialized:
            if self.attn_bias_shape:
                self.attn_bias = torch.zeros(self.attn_bias_shape, device=device, dtype=dtype)
                self.attn_bias = build_attn_bias(self.attn_impl, self.attn_bias, N_HEADS, MAX_SEQ_LEN,
                                                 causal=self.is_causal, alibi=self.alibi,
                                                 alibi_bias_max=self.alibi_bias_max)
            self._attn_bias_initialized = True

        attn_bias = self.attn_bias.to(dtype=dtype, device=device)

        if self.prefix_lm:
            attn_bias = self._apply_prefix_mask(attn_bias, prefix_mask)

        if attention_mask is not None:
            s_k = attention_mask.shape[-1]
            _s_k = max(0, attn_bias.size(-1) - s_k)
            attn_bias = attn_bias[:, :, :, _s_k:]
            if prefix_mask is not None and (attention_mask.shape != prefix_mask.shape):
                raise ValueError('attention_mask and prefix_mask shapes differ')
            min_val = torch.finfo(attn_bias.dtype).min
            attn_bias = attn_bias.masked_fill(~attention_mask.view(-1, 1, 1, s_k), min_val)
        return attn_bias, attention_mask

    def _apply_prefix_mask(self, attn_bias, prefix_mask):
        s_k, s_q = attn_bias.shape[-2:]
        if (s_k != MAX_SEQ_LEN) or (s_q != MAX_SEQ_LEN):
            raise ValueError('attn_bias does not match the expected shape')
        seq_len = prefix_mask.shape[-1]
        if seq_len > MAX_SEQ_LEN:
            raise ValueError('prefix_mask sequence length cannot exceed max_seq_len')
        attn_bias = attn_bias[..., :seq_len, :seq_len]
        # Mix the causal mask and the bidirectional mask to get the full allowable attention
        causal = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool,
                                       device=prefix_mask.device)).view(1, 1, seq_len, seq_len)
        prefix = prefix_mask.view(-1, 1, 1, seq_len)
        cannot_attend = ~torch.logical_or(causal, prefix.bool())
        min_val = torch.finfo(attn_bias.dtype).min
        attn_bias = attn_bias.masked_fill(cannot_attend, min_val)
        return attn_bias

    def forward(self, input_ids, past_key_values=None, attention_mask=None, prefix_mask=None, use_cache=False):
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if prefix_mask is not None:
            prefix_mask = prefix_mask.bool()
        if self.training and attention_mask is not None and \
                attention_mask[:, 0].sum() != attention_mask.shape[0]:
            raise NotImplementedError('MPT does not support training with left padding.')
        if self.prefix_lm and prefix_mask is None:
            raise ValueError('prefix_mask is a required argument when MPT is configured with prefix_lm=True.')
        S = input_ids.size(1)
        x = self.wte(input_ids)
        attn_bias, attention_mask = self._attn_bias(device=x.device, dtype=torch.float32,
                                                    attention_mask=attention_mask, prefix_mask=prefix_mask)
        presents = () if use_cache else None
        if use_cache and past_key_values is None:
            past_key_values = [() for _ in range(N_LAYERS)]
        for b_idx, block in enumerate(self.blocks):
            past_key_value = past_key_values[b_idx] if past_key_values is not None else None
            x, present = block(x, past_key_value=past_key_value, attn_bias=attn_bias,
                               attention_mask=attention_mask, is_causal=self.is_causal)
            if presents is not None:
                presents += (present,)
        return self.norm_f(x), presents


class MPTForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = MPTModel()
        # config.tie_word_embeddings = False -> a separate lm_head
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, prefix_mask=None, use_cache=False):
        h, presents = self.transformer(input_ids, past_key_values=past_key_values,
                                       attention_mask=attention_mask, prefix_mask=prefix_mask,
                                       use_cache=use_cache)
        logits = self.lm_head(h)
        return logits, presents

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        attention_mask = kwargs['attention_mask'].bool()
        if attention_mask[:, -1].sum() != attention_mask.shape[0]:
            raise NotImplementedError('MPT does not support generation with right padding.')
        if past_key_values is not None:
            input_ids = input_ids[:, -1].unsqueeze(-1)
        # Leverage a convenience of sequential generation!
        prefix_mask = torch.ones_like(attention_mask)
        return {'input_ids': input_ids, 'attention_mask': attention_mask, 'prefix_mask': prefix_mask,
                'past_key_values': past_key_values, 'use_cache': True}


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    """HF-style greedy loop: the mask grows by a column of ones each step."""
    past = None
    step_logits = []
    for _ in range(max_new_tokens):
        inputs = model.prepare_inputs_for_generation(input_ids, past_key_values=past, attention_mask=attention_mask)
        logits, past = model(**inputs)
        step_logits.append(logits[:, -1])
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, nxt], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=1)
    return input_ids, torch.stack(step_logits, 1)


# ----------------------------------------------------------------------------
# Independent reference: one sequence, no padding, no cache, per-query loop.
# ----------------------------------------------------------------------------
def ref_forward(model, ids, prefix_len):
    t = model.transformer
    slopes = gen_slopes(N_HEADS, ALIBI_BIAS_MAX).view(N_HEADS)
    L = ids.numel()
    x = t.wte(ids)
    for blk in t.blocks:
        a = blk.norm_1(x)
        qkv = blk.attn.Wqkv(a)
        q, k, v = qkv.split(D_MODEL, dim=-1)
        hd = D_MODEL // N_HEADS
        q = q.view(L, N_HEADS, hd)
        k = k.view(L, N_HEADS, hd)
        v = v.view(L, N_HEADS, hd)
        out = torch.zeros(L, N_HEADS, hd)
        for i in range(L):
            allowed = [j for j in range(L) if j <= i or j < prefix_len]
            for h in range(N_HEADS):
                sc = torch.stack([(q[i, h] * k[j, h]).sum() / math.sqrt(hd) - slopes[h] * abs(i - j)
                                  for j in allowed])
                p = torch.softmax(sc, 0)
                out[i, h] = (p[:, None] * v[allowed, h]).sum(0)
        x = x + blk.attn.out_proj(out.reshape(L, D_MODEL))
        x = x + blk.ffn(blk.norm_2(x))
    x = t.norm_f(x)
    return model.lm_head(x)


def main():
    model = MPTForCausalLM()
    ok_all = True

    # --- 1) training-style forward: right padding, bidirectional_mask over the prompt ---
    seqs = [([3, 5, 7], [9, 11, 2, 4]), ([8, 1], [6, 13, 20, 21, 22, 5]), ([4, 4, 12, 30, 2], [17])]
    T = max(len(p) + len(r) for p, r in seqs)
    input_ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), T, dtype=torch.long)
    bidirectional_mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, (p, r) in enumerate(seqs):
        toks = p + r
        input_ids[b, :len(toks)] = torch.tensor(toks)
        attention_mask[b, :len(toks)] = 1
        bidirectional_mask[b, :len(p)] = 1
    model.train()   # no dropout in this model; train mode exercises MPT's "no left padding" check
    with torch.no_grad():
        logits, _ = model(input_ids, attention_mask=attention_mask, prefix_mask=bidirectional_mask)
    model.eval()
    for b, (p, r) in enumerate(seqs):
        toks = torch.tensor(p + r)
        with torch.no_grad():
            ref = ref_forward(model, toks, len(p))
        got = logits[b, :len(toks)]
        match = torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
        ok_all &= match
        print(f'train forward row {b} (prefix {len(p)}, len {len(toks)}, right-padded to {T}): '
              f'max|diff|={float((got - ref).abs().max()):.2e} match={match}')

    # --- 2) cached greedy generation from left-padded prompts, prefix_mask = ones ---
    prompts = [[5, 9, 2, 14, 3], [7, 1], [22, 8, 30]]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    am = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        am[b, P - len(p):] = 1
    NEW = 6
    out, out_logits = greedy_generate(model, ids, am, NEW)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            seq = list(p)
            ref_logits = []
            for _ in range(NEW):
                lg = ref_forward(model, torch.tensor(seq), len(p))
                ref_logits.append(lg[-1])
                seq.append(int(lg[-1].argmax()))
            ref_logits = torch.stack(ref_logits)
            got = out[b, P:].tolist()
            want = seq[len(p):]
            diff = float((out_logits[b] - ref_logits).abs().max())
            match = got == want and diff < 1e-4
            ok_all &= match
            print(f'generate row {b} (prompt {len(p)}, left-padded to {P}): batched={got} alone={want} '
                  f'step-logits max|diff|={diff:.2e} match={match}')

    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
