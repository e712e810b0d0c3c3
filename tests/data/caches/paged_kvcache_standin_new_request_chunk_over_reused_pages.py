"""A paged generator over a CPU stand-in of flash_attn_with_kvcache, under inference_mode (quiet).

Requests arrive one after another; each is prefilled in chunks into pages of 4 slots through its block table, then
decoded. The stand-in keeps flash-attn's contract: the new keys `k` are written at `cache_seqlens`, query i of a row sits
at `cache_seqlens + i` and sees the keys up to itself. A new request's first chunk of 2 tokens runs over its one fresh
pages: 2 queries at positions 0 and 1 over 8 slots that still hold the last request's keys, unwritten by this one (masked by the kernel, not a mask cut
from the top-left corner behind a cache). Self-check: every request run alone in one causal pass gives the logits the
generator sampled from.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, V, PAGE, PAGES = 16, 2, 40, 4, 16
emb = torch.nn.Embedding(V, D)
qkv = torch.nn.Linear(D, 3 * D)
head = torch.nn.Linear(D, V)
pos_emb = torch.nn.Embedding(64, D)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
    """q (B, Lq, H, d); caches (pages, PAGE, H, d); k, v (B, Lq, H, d) appended at cache_seqlens (B,)."""
    batch, q_len = q.shape[:2]
    for b in range(batch):
        for i in range(q_len):
            at = int(cache_seqlens[b]) + i
            page = int(block_table[b, at // PAGE])
            k_cache[page, at % PAGE], v_cache[page, at % PAGE] = k[b, i], v[b, i]
    slots = block_table.shape[1] * PAGE
    keys = k_cache[block_table.long()].reshape(batch, slots, H, -1).transpose(1, 2)
    values = v_cache[block_table.long()].reshape(batch, slots, H, -1).transpose(1, 2)
    total = cache_seqlens.long() + q_len
    key_at = torch.arange(slots)[None, None, :]
    query_at = cache_seqlens.long()[:, None, None] + torch.arange(q_len)[None, :, None]
    visible = (key_at < total[:, None, None]) & (~torch.tensor(causal) | (key_at <= query_at))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible[:, None])
    return out.transpose(1, 2)


class Model(torch.nn.Module):
    def forward(self, ids, start, k_cache, v_cache, cache_seqlens, block_table):
        x = emb(ids) + pos_emb(torch.arange(start, start + ids.shape[1]))
        q, k, v = qkv(x).view(*ids.shape, 3, H, D // H).unbind(2)
        y = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=True)
        return head(x + y.reshape(*ids.shape, D))


def main():
    model = Model()
    k_cache, v_cache = torch.zeros(PAGES, PAGE, H, D // H), torch.zeros(PAGES, PAGE, H, D // H)
    free = list(range(PAGES))
    prompts, outputs = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]], []
    for prompt in prompts:
        pages = -(-(len(prompt) + 3) // PAGE)  # (the prompt and 3 new tokens)
        table = torch.tensor([[free.pop(0) for _ in range(pages)]], dtype=torch.int32)
        length, logits, tokens = 0, [], list(prompt)
        for start in range(0, len(prompt), 4):  # (chunked prefill: at most 4 new tokens a call)
            chunk = prompt[start:start + 4]
            out = model(torch.tensor([chunk]), length, k_cache, v_cache,
                        torch.tensor([length], dtype=torch.int32), table)
            length += len(chunk)
        logits.append(out[0, -1])
        for _ in range(3):
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), length, k_cache, v_cache,
                        torch.tensor([length], dtype=torch.int32), table)
            length += 1
            logits.append(out[0, -1])
        outputs.append((prompt, tokens, torch.stack(logits)))
        free[:0] = [int(p) for p in table[0]]  # (freed pages first: the next request writes over their stale keys)
    for prompt, tokens, got in outputs:
        ids = torch.tensor([tokens])
        x = emb(ids) + pos_emb(torch.arange(len(tokens))[None])
        q, k, v = qkv(x).view(1, len(tokens), 3, H, D // H).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        want = head(x + y.transpose(1, 2).reshape(1, len(tokens), D))[0, len(prompt) - 1:]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    print("every request's logits match the request run alone")


with torch.inference_mode():
    main()
