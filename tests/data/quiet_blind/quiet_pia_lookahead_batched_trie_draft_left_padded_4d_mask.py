"""Lookahead (PIA, alipay/PainlessInferenceAcceleration) batched trie-draft verification, ported small.

Follows pia/lookahead/common/pretrained_model_batch.py (lookahead_generation: the [bs,1,max,max] 0/1
mask `tril(attention_mask[:, None, None].expand(...))` from a LEFT-padded 2-D mask;
lookahead_prepare_inputs_for_generation: prefill slice `attention_mask[:, :, :length, :length]`, decode
mask `cat([attention_mask[:, :, min_cur:min_cur+size, :min_cur], decoding_masks], -1)`;
_lookahead_update_model_kwargs_for_generation: leaf/branch walk over the draft mask and _update_cache)
and pia/lookahead/models/llama/modeling_llama_batch.py (LlamaModel.forward lookahead branch:
`position_ids = sum(attention_mask, -1) - 1`, `(1 - mask) * finfo.min`; LlamaAttention: fused qkv with
q pre-divided by sqrt(head_dim), a preallocated KV buffer written at `decoding_cursors`, `_attn` with
baddbmm for bs == 1 and matmul + add_ otherwise). Draft trees are laid out as
pia/lookahead/common/lookahead_cache.py hands them (root first, depth-first, each token sees root and
its ancestors).

Left-padded pad rows see nothing: their row is all finfo.min, a uniform softmax over finite values
(on purpose; their outputs are never read). Checked against each prompt run alone, unpadded, without
cache: every tree node's logits, the accepted tokens (greedy), and the compacted KV cache.
"""
import math

import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)
V, D, NH, NL = 67, 32, 4, 2
HD = D // NH
PAD = 0


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=256, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        cached = torch.stack([torch.stack([cos, -sin], dim=1), torch.stack([sin, cos], dim=1)], dim=1)
        self.register_buffer("cached", cached, persistent=False)

    def forward(self, x, seq_len=None):
        return self.cached[:seq_len, ...]


def apply_rotary_pos_emb(q, k, cached, position_ids):
    # cached: [seq_len, 2, 2, dim//2]
    position_ids = position_ids.unsqueeze(1)  # [bs, 1, seq_len]
    c = cached[position_ids]  # [bs, 1, seq_len, 2, 2, dim//2]
    shape = q.shape
    update_shape = shape[:-1] + (1, 2, shape[-1] // 2)
    q_embed = (c * q.view(*update_shape)).sum(-2).view(shape)
    k_embed = (c * k.view(*update_shape)).sum(-2).view(shape)
    return q_embed, k_embed


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(HD)
        coef = math.sqrt(HD)
        # normed: q weights pre-divided by sqrt(head_dim), fused qkv (as the first forward builds it)
        self.query_key_value = nn.Linear(D, 3 * D, bias=False)
        self.query_key_value.weight = nn.Parameter(
            torch.cat([self.q_proj.weight.data / coef, self.k_proj.weight.data, self.v_proj.weight.data], 0),
            requires_grad=False)
        self.cache_seqlens = None

    def _attn(self, query, key, value, attention_mask=None):
        if query.size(0) == 1:
            attn_weights = torch.baddbmm(attention_mask.squeeze(0), query.squeeze(0), key.squeeze(0).transpose(-1, -2))
        else:
            attn_weights = torch.matmul(key, query.transpose(-1, -2)).transpose(-1, -2)
            attn_weights = attn_weights.add_(attention_mask)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value, decoding_kwargs):
        bs, l = hidden_states.shape[:2]
        kv_seq_len = past_key_value[0].shape[2] if past_key_value is not None else l
        mat = self.query_key_value(hidden_states)
        shape = mat.size()[:-1] + (3, NH, HD)
        query_states, key_states, value_states = mat.view(shape).permute(0, 3, 2, 1, 4).unbind(2)
        cached = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cached, position_ids)
        if past_key_value is None:
            attn_output, _ = self._attn(query_states, key_states, value_states, attention_mask=attention_mask)
            decoding_max_length = decoding_kwargs.get('decoding_max_length', None)
            zeros = torch.zeros([bs, NH, decoding_max_length - l, HD], dtype=hidden_states.dtype)
            past_key_value = [torch.cat([key_states, zeros], 2), torch.cat([value_states, zeros], 2)]
            self.cache_seqlens = l
        else:
            past_key, past_value = past_key_value
            decoding_cursors = decoding_kwargs.get('decoding_cursors', None)
            max_len = max(decoding_cursors) + l
            cs = list(set(decoding_cursors))
            if len(cs) == 1:
                c = cs[0]
                past_key[:, :, c: c + l] = key_states
                past_value[:, :, c: c + l] = value_states
            else:
                for i, cursor in enumerate(decoding_cursors):
                    past_key[i, :, cursor: cursor + l] = key_states[i]
                    past_value[i, :, cursor: cursor + l] = value_states[i]
            attn_output, _ = self._attn(query_states, past_key[:, :, :max_len], past_value[:, :, :max_len],
                                        attention_mask=attention_mask)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous().view(bs, l, D)
        return self.o_proj(attn_output), past_key_value


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(D), RMSNorm(D)
        self.self_attn = LlamaAttention()
        self.gate, self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)

    def forward(self, x, mask, pos, past, decoding_kwargs):
        h, present = self.self_attn(self.ln1(x), mask, pos, past, decoding_kwargs)
        x = x + h
        x = x + self.down(nn.functional.silu(self.gate(self.ln2(x))) * self.up(self.ln2(x)))
        return x, present


class LlamaForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer() for _ in range(NL)])
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids, attention_mask, past_key_values=None, decoding_kwargs=None):
        inputs_embeds = self.embed_tokens(input_ids)
        # lookahead branch: attention_mask [bs, 1, src_len, tgt_len] of 0/1
        assert attention_mask.dim() == 4
        position_ids = torch.sum(attention_mask, dim=-1).squeeze(1) - 1
        dtype = inputs_embeds.dtype
        attention_mask = (1.0 - attention_mask.to(dtype)) * torch.finfo(dtype).min
        hidden_states = inputs_embeds
        next_cache = []
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, attention_mask, position_ids, past, decoding_kwargs)
            next_cache.append(present)
        hidden_states = self.norm(hidden_states)
        if past_key_values is None:
            hidden_states = hidden_states[:, -1:]
        return self.lm_head(hidden_states), next_cache

    # independent reference: one unpadded sequence, no cache, plain causal mask, arange positions
    @torch.no_grad()
    def reference(self, ids):
        n = len(ids)
        x = self.embed_tokens(torch.tensor(ids)[None])
        pos = torch.arange(n)
        keys = []
        for layer in self.layers:
            a = layer.self_attn
            h = layer.ln1(x)
            q = (h @ a.q_proj.weight.T).view(1, n, NH, HD).transpose(1, 2)
            k = (h @ a.k_proj.weight.T).view(1, n, NH, HD).transpose(1, 2)
            v = (h @ a.v_proj.weight.T).view(1, n, NH, HD).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, a.rotary_emb.cached, pos[None])
            keys.append(k[0])
            out = torch.zeros_like(q)
            for i in range(n):  # loop over query positions: keys 0..i only
                s = (q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-1, -2)) / math.sqrt(HD)
                out[:, :, i:i + 1] = torch.softmax(s, -1) @ v[:, :, :i + 1]
            x = x + a.o_proj(out.transpose(1, 2).reshape(1, n, D))
            h2 = layer.ln2(x)
            x = x + layer.down(nn.functional.silu(layer.gate(h2)) * layer.up(h2))
        return self.lm_head(self.norm(x))[0], keys


def tree_mask(parents):
    """Draft laid out as lookahead_cache hands it: index 0 is the root (the last accepted token),
    then nodes depth-first; row i is 1 on i, its ancestors and the root."""
    n = len(parents)
    m = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = 1
            j = parents[j]
    return m


@torch.no_grad()
def main():
    model = LlamaForCausalLM().eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (5,), generator=g).tolist(), torch.randint(3, V, (7,), generator=g).tolist()]
    bs = len(prompts)
    input_length = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (input_length - len(p)) + p for p in prompts])  # LEFT padding
    attention_mask = (input_ids != PAD).long()

    # greedy continuations of each prompt alone (used to lay out drafts and to check acceptance)
    greedy = []
    for p in prompts:
        ids = list(p)
        for _ in range(5):
            lg, _ = model.reference(ids)
            ids.append(int(lg[-1].argmax()))
        greedy.append(ids[len(p):])

    # lookahead_generation: the full [bs, 1, max, max] 0/1 mask
    decoding_length, stop_max_length = 4, 16
    decoding_max_length = stop_max_length + decoding_length + 1
    src_len = attention_mask.shape[1]
    pad_len = decoding_max_length - src_len
    am = torch.cat([attention_mask, torch.ones((bs, pad_len), dtype=torch.long)], 1)
    full_attention_mask = torch.tril(am[:, None, None].expand(-1, -1, decoding_max_length, -1), 0)
    decoding_kwargs = {'decoding_max_length': decoding_max_length}

    # prefill
    update_attention_mask = full_attention_mask[:, :, :input_length, :input_length]
    logits, past_key_values = model(input_ids, update_attention_mask, None, decoding_kwargs)
    next_tokens = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
    input_ids = torch.cat([input_ids, torch.ones((bs, stop_max_length - input_length), dtype=torch.long) * PAD], 1)
    input_ids[:, input_length:input_length + 1] = next_tokens
    decoding_cursors = [input_length] * bs
    ok_prefill = all(int(next_tokens[b]) == greedy[b][0] for b in range(bs))

    # drafts (same size for every row, as bat_get returns them): row 0's right branch is 3 deep,
    # row 1's first branch is wrong and its right branch is the second one
    t0, t1 = greedy[0], greedy[1]
    drafts = [
        ([t0[0], t0[1], t0[2], t0[3], 7], [-1, 0, 1, 2, 1]),        # root, a, b, c | b' (sibling of b)
        ([t1[0], 9, t1[1], t1[2], t1[3]], [-1, 0, 0, 2, 3]),        # root, y | a, b, c
    ]
    decoding_ids = [d[0] for d in drafts]
    decoding_masks = np.stack([tree_mask(d[1]) for d in drafts])
    size = len(decoding_ids[0])

    # lookahead_prepare_inputs_for_generation (decode step)
    min_cur = min(decoding_cursors)
    decoding_mask_tensor = torch.from_numpy(decoding_masks[:, None]).to(dtype=torch.long)
    decoding_attention_mask = torch.cat(
        [full_attention_mask[:, :, min_cur: min_cur + size, :min_cur], decoding_mask_tensor], dim=-1)
    decoding_kwargs.update({'decoding_cursors': decoding_cursors})
    logits, past_key_values = model(torch.tensor(decoding_ids), decoding_attention_mask, past_key_values, decoding_kwargs)

    # check every node against its own path, run alone
    worst = 0.0
    for b in range(bs):
        ids, parents = drafts[b]
        for i in range(size):
            path, j = [], i
            while j != -1:
                path.append(ids[j])
                j = parents[j]
            ref, _ = model.reference(prompts[b] + path[::-1])
            worst = max(worst, (ref[-1] - logits[b, i]).abs().max().item())

    # _lookahead_update_model_kwargs_for_generation: walk branches, accept, compact the cache
    accepted = []
    cache_ok = True
    for batch_index in range(bs):
        cur = decoding_cursors[batch_index]
        draft_ids = decoding_ids[batch_index][1:]
        draft_masks = decoding_masks[batch_index, 1:, cur - min_cur + 1:]
        branch_lengths = np.sum(draft_masks, axis=1)
        max_branch_length = np.max(branch_lengths)
        leaf_indices = []
        for i, l in enumerate(branch_lengths):
            if i == 0 or l > branch_lengths[i - 1]:
                continue
            leaf_indices.append(i - 1)
        leaf_indices.append(-1)
        leaf_draft_masks = draft_masks[leaf_indices]
        leaf_branch_lengths = branch_lengths[leaf_indices]
        seg = [0] + np.cumsum(leaf_branch_lengths).tolist()
        nonzero_indices = np.nonzero(leaf_draft_masks)[1].tolist()
        mask_indices = [nonzero_indices[seg[i]:seg[i + 1]] for i in range(len(seg) - 1)]
        draft_branches = [[draft_ids[i] for i in indices] for indices in mask_indices]
        lg = logits[batch_index:batch_index + 1]
        next_token_list, logit_indices = [], []
        for i in range(-1, min(max_branch_length, stop_max_length - cur - 2)):
            logit_index = 0 if i == -1 else mask_indices[0][i] + 1
            next_token_id = int(torch.argmax(lg[:, logit_index], dim=-1))
            input_ids[batch_index, cur + i + 2] = next_token_id
            next_token_list.append(next_token_id)
            logit_indices.append(logit_index)
            if i == max_branch_length - 1:
                break
            upd_m, upd_b = [], []
            for j, branch in enumerate(draft_branches):
                if len(branch) > i + 1 and branch[i + 1] == next_token_id:
                    upd_m.append(mask_indices[j])
                    upd_b.append(branch)
            if len(upd_m) == 0:
                break
            mask_indices, draft_branches = upd_m, upd_b
        max_match_count = len(next_token_list) - 1
        max_match_index = logit_indices[-1] - 1
        decoding_cursors[batch_index] += max_match_count + 1
        if max_match_index + 1 != max_match_count:
            context_length = cur + 1
            kv_idx = torch.tensor(logit_indices[1:], dtype=torch.long) - 1 + context_length
            for k, v in past_key_values:  # _update_cache
                k[batch_index, :, context_length:context_length + max_match_count] = k[batch_index, :, kv_idx]
                v[batch_index, :, context_length:context_length + max_match_count] = v[batch_index, :, kv_idx]
        accepted.append(next_token_list)
        # the cache's real slots (pads excluded) must equal the keys of the sequence run alone
        npad = input_length - len(prompts[batch_index])
        kept = prompts[batch_index] + [decoding_ids[batch_index][0]] + next_token_list[:-1]
        _, ref_keys = model.reference(kept)
        for layer_idx, (k, _) in enumerate(past_key_values):
            got = k[batch_index, :, npad:npad + len(kept)]
            cache_ok &= torch.allclose(got, ref_keys[layer_idx], atol=1e-5)
    ok_accept = all(accepted[b] == greedy[b][1:1 + len(accepted[b])] and len(accepted[b]) == 4 for b in range(bs))

    match = ok_prefill and worst < 1e-4 and ok_accept and cache_ok
    print(f"PIA lookahead batch verify: max |logit diff| = {worst:.2e}, accepted = {accepted}, "
          f"cache ok = {cache_ok}; matches reference: {match}")
    assert match


if __name__ == "__main__":
    main()
