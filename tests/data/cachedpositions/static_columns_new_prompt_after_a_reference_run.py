"""A fixed-shape engine's cache begun anew for a second prompt, after a reference run at the same layer (quiet).

One decoder layer serves both a reference run (a whole sequence at once, positions 0..L-1, no cache) and an engine of
fixed shapes: COLUMNS cache slots, left-padded with blank entries the causal mask zeroes, each call's own keys after
them, and the oldest slots dropped from the left as the call's keys are appended (DeepSparse's DecoderKVCache). The
reference run of prompt A comes first; prompt B then starts on a new, blank cache: its prefill sees only its own keys,
and its decode steps, numbered after B's own tokens, see B's keys in the slots where A's reference run had its later
positions. Self-check: B's greedy continuation and logits match B run alone, all at once, with no cache.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, V, COLUMNS = 16, 2, 30, 12
emb, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
inv = 1.0 / 10000 ** (torch.arange(0, D // H, 2) / (D // H))


def rope(x, positions):
    ang = positions[None, None, :, None].float() * inv
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1).flatten(-2)


def heads(x):
    return x.view(1, x.shape[1], H, D // H).transpose(1, 2)


class Layer(torch.nn.Module):
    def forward(self, x, positions, mask, past_k=None, past_v=None):
        q, k, v = rope(heads(wq(x)), positions), rope(heads(wk(x)), positions), heads(wv(x))
        if past_k is not None:
            k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + out.transpose(1, 2).reshape(x.shape), k, v


layer = Layer()


def reference(ids):
    x = emb(torch.tensor([ids]))
    n = len(ids)
    out, _, _ = layer(x, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    return head(out)[0]


def engine(prompt, new_tokens):
    """The fixed-shape engine: a blank cache of COLUMNS slots; each call appends its keys and drops as many slots."""
    past_k = past_v = torch.zeros(1, H, COLUMNS, D // H)
    processed, tokens, logits = 0, list(prompt), []
    step = prompt
    while len(logits) < new_tokens:
        n = len(step)
        x = emb(torch.tensor([step]))
        mask = torch.zeros(n, COLUMNS + n, dtype=torch.bool)
        mask[:, COLUMNS - processed:COLUMNS] = True  # (the cached real slots; the blank ones stay hidden)
        mask[:, COLUMNS:] = torch.ones(n, n, dtype=torch.bool).tril()
        out, k, v = layer(x, torch.arange(processed, processed + n), mask, past_k, past_v)
        past_k, past_v = k[:, :, n:], v[:, :, n:]
        processed += n
        last = head(out)[0, -1]
        logits.append(last)
        tokens.append(int(last.argmax()))
        step = tokens[-1:]
    return tokens[len(prompt):], torch.stack(logits)


with torch.no_grad():
    prompt_a, prompt_b = [3, 7, 9, 11, 4, 6, 8, 2, 5], [12, 13, 14]
    reference(prompt_a)  # (the reference run of prompt A at the same layer)
    made, logits = engine(prompt_b, 4)
    want = reference(prompt_b + made[:-1])[len(prompt_b) - 1:]
    assert torch.allclose(logits, want, atol=1e-5), (logits - want).abs().max()
    assert made == [int(t) for t in want.argmax(-1)]
    print("prompt B's engine run matches B alone:", made)
