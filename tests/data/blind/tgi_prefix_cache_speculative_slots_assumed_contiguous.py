"""TGI speculative decoding with prefix caching: speculative tokens' KV written to the wrong slots.

Citation: huggingface/text-generation-inference#2711 ("Fix prefix caching +
speculative decoding", merged), written from the PR description.

Bug: after a speculative step, `FlashCausalLM.generate_token` computed the slots
of the 1 + n_speculative new tokens of each request by taking the slot of the
current token and adding an arange: `slots.unsqueeze(-1).expand(B, L) +
arange_int`. With prefix caching (radix allocator, block size 1) a request's
slots are not consecutive ids, so the keys/values of the speculative tokens land
in slots that do not belong to that position (or to the request at all), while
attention reads the request's keys through its block table.

Fix: expand the *slot indices* and index the allocated slots with them:
`slots = batch.slots[(slot_indices.unsqueeze(-1).expand(B, L) + arange_int).view(-1)]`.

This program: TGI's flat slot cache, block tables (BLOCK_SIZE = 1 as with
prefix caching), `Seqlen`, the KV store `kv_cache[0][slots] = key`, and a
paged attention port (keys gathered through the block table, causal aligned
bottom-right) calling F.scaled_dot_product_attention. Two requests with
discontiguous slots, prompt prefill, then one speculative step of 1 + 2 tokens.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BLOCK_SIZE = 1
NUM_HEADS = 2
HEAD_DIM = 8
HIDDEN = NUM_HEADS * HEAD_DIM
NUM_SLOTS = 64
SPECULATIVE = 2


@dataclass
class Seqlen:
    input_lengths: torch.Tensor
    cu_seqlen_q: torch.Tensor
    cu_seqlen_k: torch.Tensor
    max_q: int
    max_k: int


class KVCache:
    def __init__(self):
        self.kv_cache = (
            torch.zeros(NUM_SLOTS, NUM_HEADS, HEAD_DIM),
            torch.zeros(NUM_SLOTS, NUM_HEADS, HEAD_DIM),
        )

    def store(self, key, value, slots):
        self.kv_cache[0][slots] = key
        self.kv_cache[1][slots] = value


def paged_attention_varlen(query, kv_cache, block_tables, seqlen, softmax_scale):
    # query: (total_q, H, D); keys come from the block table, causal bottom-right.
    out = torch.empty_like(query)
    for i in range(block_tables.shape[0]):
        q0, q1 = int(seqlen.cu_seqlen_q[i]), int(seqlen.cu_seqlen_q[i + 1])
        k_len = int(seqlen.input_lengths[i])
        blocks = block_tables[i, : (k_len + BLOCK_SIZE - 1) // BLOCK_SIZE]
        slots = (blocks.unsqueeze(-1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(-1)[:k_len]
        k = kv_cache.kv_cache[0][slots]
        v = kv_cache.kv_cache[1][slots]
        q = query[q0:q1]
        q_len = q1 - q0
        qi = torch.arange(q_len).unsqueeze(1) + (k_len - q_len)
        ki = torch.arange(k_len).unsqueeze(0)
        mask = ki <= qi
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=softmax_scale,
        )
        out[q0:q1] = o[0].transpose(0, 1)
    return out


class FlashAttentionLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query_key_value = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.softmax_scale = HEAD_DIM ** -0.5

    def forward(self, hidden_states, kv_cache, block_tables, slots, seqlen):
        qkv = self.query_key_value(hidden_states).view(-1, 3, NUM_HEADS, HEAD_DIM)
        query, key, value = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        kv_cache.store(key, value, slots)
        attn = paged_attention_varlen(query, kv_cache, block_tables, seqlen, self.softmax_scale)
        return self.o_proj(attn.reshape(-1, HIDDEN))


def make_seqlen(q_lens, k_lens):
    q = torch.tensor(q_lens)
    k = torch.tensor(k_lens)
    return Seqlen(
        input_lengths=k,
        cu_seqlen_q=torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]),
        cu_seqlen_k=torch.cat([torch.zeros(1, dtype=torch.long), k.cumsum(0)]),
        max_q=int(q.max()), max_k=int(k.max()),
    )


layer = FlashAttentionLayer().eval()
embed = torch.nn.Embedding(100, HIDDEN)
kv_cache = KVCache()

# Radix allocator: request 0 reuses a cached prefix, slots are scattered.
# batch.slots is the flat concatenation of every request's allocated slots.
request_slots = [
    [11, 4, 27, 9, 33, 16, 40, 2],     # prompt 5 tokens + room for 3 more
    [20, 21, 7, 50, 13, 44, 38, 30],   # prompt 5 tokens + room for 3 more
]
prompts = [[5, 17, 42, 8, 3], [9, 61, 22, 14, 70]]
batch_slots = torch.tensor(request_slots[0] + request_slots[1])
slots_start = torch.tensor([0, len(request_slots[0])])
block_tables = torch.tensor(request_slots)  # BLOCK_SIZE == 1: one block per slot

with torch.no_grad():
    # Prefill the prompts.
    prompt_len = torch.tensor([len(p) for p in prompts])
    prefill_slot_indices = torch.cat([slots_start[i] + torch.arange(len(p)) for i, p in enumerate(prompts)])
    slots = batch_slots[prefill_slot_indices]
    ids = torch.tensor(sum(prompts, []))
    layer(embed(ids), kv_cache, block_tables, slots, make_seqlen(prompt_len.tolist(), prompt_len.tolist()))

    # Speculative step: current token plus SPECULATIVE draft tokens per request.
    B = len(prompts)
    L = 1 + SPECULATIVE
    arange_int = torch.arange(L, dtype=torch.int64)
    slot_indices = slots_start + prompt_len  # index into batch.slots of the current token
    if FIXED:
        spec_slot_indices = (slot_indices.unsqueeze(-1).expand(B, L) + arange_int).view(-1)
        slots = batch_slots[spec_slot_indices]
    else:
        slots = batch_slots[slot_indices]
        slots = (slots.unsqueeze(-1).expand(B, L) + arange_int).view(-1)
    new_ids = torch.tensor([[12, 55, 31], [66, 1, 48]]).view(-1)
    out = layer(embed(new_ids), kv_cache, block_tables, slots,
                make_seqlen([L] * B, (prompt_len + L).tolist()))
    logits = out @ embed.weight.T
    print("speculative slots:", slots.tolist())
    print("verify argmax:", logits.argmax(-1).view(B, L).tolist())
    print("out[0, :4]:", [round(x, 4) for x in out[0, :4].tolist()])
