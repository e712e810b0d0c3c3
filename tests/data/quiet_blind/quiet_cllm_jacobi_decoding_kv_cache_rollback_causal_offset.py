"""Consistency LLM (hao-ai-lab/Consistency_LLM) Jacobi decoding with KV-cache rollback, ported small.

Follows cllm/cllm_llama_modeling.py (jacobi_forward: prefill_phase with
`_prepare_4d_causal_attention_mask(attention_mask, (bsz, seq_len), inputs_embeds, past_key_values_length)`,
the generation phase that re-feeds the not-yet-converged suffix of the n-token block over the cache with
a bottom-right aligned causal mask and `position_ids = arange(past_len, past_len + seq_len)`, and
`delete_false_key_value` trimming the cache of the false tokens each iteration), driven the way
eval/gsm8k/speedup.py drives it (not read here: blocks of n tokens, each starting from `first_correct_token`).
The 4-D additive mask is transformers' `_make_causal_mask` (finfo.min fill, zeros over the past).

Jacobi's fixed point is greedy decoding: checked against a cache-free greedy loop (plain causal,
full recompute), and the final KV cache against the keys of the whole sequence run once.
"""
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
V, D, NH, NL = 53, 32, 4, 2
HD = D // NH

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0, max_pos=128):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_pos).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, position_ids):
        return self.cos_cached[position_ids], self.sin_cached[position_ids]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.rotary = Rotary(HD)

    def forward(self, x, attention_mask, position_ids, past):
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        cos, sin = self.rotary(position_ids)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HD)
        if attention_mask is not None:
            assert attention_mask.size() == (b, 1, q_len, k.shape[2])
            w = w + attention_mask
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, q_len, D)
        return self.o_proj(o), present


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(D), RMSNorm(D)
        self.attn = Attention()
        self.gate, self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)

    def forward(self, x, mask, pos, past):
        h, present = self.attn(self.ln1(x), mask, pos, past)
        x = x + h
        x = x + self.down(nn.functional.silu(self.gate(self.ln2(x))) * self.up(self.ln2(x)))
        return x, present


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer() for _ in range(NL)])
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def run(self, input_ids, mask4d, position_ids, past_key_values=None):
        x = self.embed_tokens(input_ids)
        new_past = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, mask4d, position_ids, None if past_key_values is None else past_key_values[i])
            new_past.append(present)
        return self.lm_head(self.norm(x)).float(), new_past



# ---------------------------------------------------------------- transformers mask utils (as CLLM used them)
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    assert attention_mask is None  # CLLM passes None in the generation phase and an all-ones prompt
    if input_shape[-1] > 1:
        return _make_causal_mask(input_shape, inputs_embeds.dtype, inputs_embeds.device, past_key_values_length)
    return None


class DynamicCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_usable_length(self, new_len):
        return 0 if not self.key_cache else self.key_cache[0].shape[-2]

    def as_past(self):
        return None if not self.key_cache else list(zip(self.key_cache, self.value_cache))

    def store(self, presents):
        self.key_cache = [k for k, _ in presents]
        self.value_cache = [v for _, v in presents]

    def delete_false_key_value(self, num_of_false_tokens):
        for layer_idx in range(len(self.key_cache)):
            self.key_cache[layer_idx] = self.key_cache[layer_idx][..., :-num_of_false_tokens, :]
            self.value_cache[layer_idx] = self.value_cache[layer_idx][..., :-num_of_false_tokens, :]


def layers_forward(model, input_ids, past_key_values):
    batch_size, seq_length = input_ids.shape
    inputs_embeds = model.embed_tokens(input_ids)
    past_key_values_length = past_key_values.get_usable_length(seq_length)
    position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length, dtype=torch.long)[None]
    attention_mask = _prepare_4d_causal_attention_mask(None, (batch_size, seq_length), inputs_embeds,
                                                       past_key_values_length)
    logits, presents = model.run(input_ids, attention_mask, position_ids, past_key_values.as_past())
    past_key_values.store(presents)
    return logits


@torch.no_grad()
def jacobi_forward(model, input_ids, past_key_values, prefill_phase=False):
    if prefill_phase:
        logits = layers_forward(model, input_ids, past_key_values)
        predict_next_tokens = torch.argmax(torch.nn.functional.softmax(logits, dim=-1) / 0.001, dim=-1)
        return past_key_values, predict_next_tokens[:, -1]
    accurate_n_gram = torch.zeros_like(input_ids)
    accurate_length = 0
    next_point = input_ids
    iter_counter = 0
    while True:
        current_point = next_point
        seq_length = current_point.shape[1]
        logits = layers_forward(model, current_point, past_key_values)
        all_shift_one_token = torch.argmax(torch.nn.functional.softmax(logits, dim=-1) / 0.001, dim=-1)
        next_point = torch.cat((current_point[0, 0].view(1, -1), all_shift_one_token[0, :seq_length - 1].view(1, -1)), dim=-1)
        first_false_index = torch.where(torch.eq(current_point[0], next_point[0]) == False)[0]
        if len(first_false_index) > 0:
            fast_forward_cnt = first_false_index[0].item()
            past_key_values.delete_false_key_value(seq_length - fast_forward_cnt)
        else:
            fast_forward_cnt = torch.sum(torch.eq(current_point, next_point)).item()
            accurate_n_gram[0, accurate_length: accurate_length + fast_forward_cnt] = next_point[0, :fast_forward_cnt]
            first_correct_token = all_shift_one_token[:, -1]
            break
        accurate_n_gram[0, accurate_length: accurate_length + fast_forward_cnt] = next_point[0, :fast_forward_cnt]
        accurate_length += fast_forward_cnt
        next_point = next_point[0, fast_forward_cnt:].view(1, -1)
        iter_counter += 1
    return accurate_n_gram, first_correct_token, iter_counter, accurate_length


@torch.no_grad()
def main():
    model = TinyLlama().eval()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, V, (1, 7), generator=g)
    n_token_seq_len, max_new_tokens = 5, 15

    cache = DynamicCache()
    cache, first_correct_token = jacobi_forward(model, prompt, cache, prefill_phase=True)
    generated = []
    iters = []
    while len(generated) < max_new_tokens:
        # random init of the block (speedup.py style), its first token is the known-correct one
        init = torch.randint(3, V, (1, n_token_seq_len), generator=g)
        init[0, 0] = first_correct_token
        n_gram, first_correct_token, it, _ = jacobi_forward(model, init, cache)
        generated += n_gram[0].tolist()
        iters.append(it)

    # reference: greedy decoding, full recompute each step, no cache
    ref = prompt[0].tolist()
    for _ in range(len(generated)):
        n = len(ref)
        causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lg, _ = model.run(torch.tensor([ref]), causal[None, None], torch.arange(n)[None])
        ref.append(int(lg[0, -1].argmax()))
    ok_tokens = generated == ref[prompt.shape[1]:]

    # the trimmed cache holds exactly prompt + generated keys, equal to one full pass
    full = torch.tensor([prompt[0].tolist() + generated])
    n = full.shape[1]
    causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    _, presents = model.run(full, causal[None, None], torch.arange(n)[None])
    ok_cache = all(ck.shape == pk.shape and torch.allclose(ck, pk, atol=1e-5)
                   for ck, (pk, _) in zip(cache.key_cache, presents))

    match = ok_tokens and ok_cache
    print(f"CLLM Jacobi decoding: {len(generated)} tokens in {len(iters)} blocks, iterations {iters}; "
          f"greedy match {ok_tokens}, cache match {ok_cache}; matches reference: {match}")
    assert match


if __name__ == "__main__":
    main()
