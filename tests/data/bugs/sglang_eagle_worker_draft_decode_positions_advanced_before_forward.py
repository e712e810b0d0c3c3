# sglang (sgl-project/sglang#25015, "Fix Eagle draft decode positions"): EAGLEWorker.draft_forward
# advanced forward_batch.positions with add_(1) *before* each draft decode forward, so every draft
# decode step ran RoPE at position+1 relative to the KV it wrote and attended (draft step 0 at 8 instead of 7).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, HID, NH, HD = 64, 32, 4, 8


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, positions):  # x: [T, H, D], positions: [T]
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = positions.double()[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    return x * cos + rotate_half(x) * sin


class ForwardBatch:
    def __init__(self):
        self.input_ids = None
        self.positions = None
        self.out_cache_loc = None
        self.seq_lens = None
        self.req_pool_indices = None


class TokenToKVPool:
    def __init__(self, size):
        self.k = torch.zeros(size, NH, HD, dtype=torch.float64)
        self.v = torch.zeros(size, NH, HD, dtype=torch.float64)


class LlamaForCausalLMEagle(nn.Module):
    """EAGLE draft head: fc(concat(embed, target hidden)) -> one decoder layer -> lm_head."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HID)
        self.fc = nn.Linear(2 * HID, HID)
        self.qkv_proj = nn.Linear(HID, 3 * HID)
        self.o_proj = nn.Linear(HID, HID)
        self.lm_head = nn.Linear(HID, VOCAB)

    def forward(self, input_ids, positions, hidden_states, forward_batch, pool, req_to_token, extend_lens):
        h = self.fc(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        q, k, v = self.qkv_proj(h).view(-1, 3, NH, HD).unbind(1)
        q, k = apply_rope(q, positions), apply_rope(k, positions)
        pool.k[forward_batch.out_cache_loc] = k
        pool.v[forward_batch.out_cache_loc] = v
        outs, start = [], 0
        for b, n in enumerate(extend_lens):
            kv_len = int(forward_batch.seq_lens[b])
            locs = req_to_token[forward_batch.req_pool_indices[b], :kv_len]
            qb = q[start : start + n].transpose(0, 1)  # [H, n, D]
            kb, vb = pool.k[locs].transpose(0, 1), pool.v[locs].transpose(0, 1)
            # extend queries are the last n tokens of the kv_len keys: bottom-right causal
            mask = torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1).reshape(n, HID))
            start += n
        hidden = self.o_proj(torch.cat(outs)) + h
        return self.lm_head(hidden), hidden


model = LlamaForCausalLMEagle().double().eval()
bs, prompt_lens, speculative_num_steps = 2, [7, 5], 4
pool = TokenToKVPool(256)
req_to_token = torch.zeros(bs, 64, dtype=torch.long)
req_to_token[0] = torch.arange(0, 64)
req_to_token[1] = torch.arange(64, 128)
prompts = [torch.randint(0, VOCAB, (n,)) for n in prompt_lens]
target_hidden = [torch.randn(n, HID, dtype=torch.float64) for n in prompt_lens]

with torch.no_grad():
    # draft extend for prefill: positions 0..L-1
    fb = ForwardBatch()
    fb.req_pool_indices = torch.arange(bs)
    fb.seq_lens = torch.tensor(prompt_lens)
    fb.input_ids = torch.cat(prompts)
    fb.positions = torch.cat([torch.arange(n) for n in prompt_lens])
    fb.out_cache_loc = torch.cat([req_to_token[b, :n] for b, n in enumerate(prompt_lens)])
    logits, hidden = model(fb.input_ids, fb.positions, torch.cat(target_hidden), fb, pool, req_to_token, prompt_lens)
    last = torch.tensor(prompt_lens).cumsum(0) - 1
    topk_index = logits[last].argmax(-1)
    hidden_states = hidden[last]

    # draft decode (topk == 1 chain), as in EAGLEWorker.draft_forward
    seq_lens = torch.tensor(prompt_lens)
    fb.positions = seq_lens.clone()  # position of the first draft token (7 and 5)
    out_cache_loc = [torch.stack([req_to_token[b, prompt_lens[b] + i] for b in range(bs)]) for i in range(speculative_num_steps)]
    token_list, step_inputs, step_hidden_in, draft_logits, used_pos = [topk_index], [], [], [], []
    for i in range(speculative_num_steps):
        input_ids = token_list[-1]
        if i == speculative_num_steps - 1:
            break
        fb.input_ids = input_ids
        fb.out_cache_loc = out_cache_loc[i]
        fb.seq_lens = seq_lens + i + 1
        if not FIXED:
            fb.positions.add_(1)
        step_inputs.append(input_ids.clone())
        step_hidden_in.append(hidden_states.clone())
        used_pos.append(fb.positions.tolist())
        logits, hidden_states = model(fb.input_ids, fb.positions, hidden_states, fb, pool, req_to_token, [1] * bs)
        draft_logits.append(logits)
        token_list.append(logits.argmax(-1))
        if FIXED:
            fb.positions.add_(1)
    print("draft decode positions per step:", used_pos, "(prompt lengths", prompt_lens, ")")

    # reference: one extend over prompt + the same draft inputs, positions 0..L+k-1, no decode path
    ref_pool = TokenToKVPool(256)
    rb = ForwardBatch()
    rb.req_pool_indices = torch.arange(bs)
    k = len(step_inputs)
    rb.seq_lens = torch.tensor(prompt_lens) + k
    ids, hin, pos, loc = [], [], [], []
    for b, n in enumerate(prompt_lens):
        ids.append(torch.cat([prompts[b], torch.stack([s[b] for s in step_inputs])]))
        hin.append(torch.cat([target_hidden[b], torch.stack([s[b] for s in step_hidden_in])]))
        pos.append(torch.arange(n + k))
        loc.append(req_to_token[b, : n + k])
    rb.out_cache_loc = torch.cat(loc)
    ref_logits, _ = model(torch.cat(ids), torch.cat(pos), torch.cat(hin), rb, ref_pool, req_to_token, [n + k for n in prompt_lens])
    ends = (torch.tensor(prompt_lens) + k).cumsum(0)
    diff = 0.0
    for i in range(k):
        for b in range(bs):
            diff = max(diff, (ref_logits[ends[b] - k + i] - draft_logits[i][b]).abs().max().item())
    print(f"max |draft decode logits - full-sequence reference| = {diff:.3e}")
