"""A decode server whose slots share one ring buffer, each slot's RoPE position its own (quiet).

Two decode slots share a ring of 16 cache columns and one write pointer. A request is prefilled alone, its prompt
right-padded to a bucket (`prefill_lengths = [4, 8]`), and inserted so that its real keys end just before the pointer; its
slot's mask row opens those columns. Each decode step writes every slot's new key at the pointer, opens that column and
moves the pointer on. The model call is handed `input_pos`, one RoPE position per slot (the slot's own token count),
not the slot written, and its one query per slot is padded to two rows (a fixed query shape, as TPU engines do), so
the attention sees as many query rows as there are slots. Self-check: every request run alone (no padding, no cache,
one call per layer in a loop) gives the logits the server sampled from.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, V, RING, SLOTS = 16, 2, 40, 16, 2
emb = torch.nn.Embedding(V, D)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
head = torch.nn.Linear(D, V)
LAYERS = 2
inv = 1.0 / 10000 ** (torch.arange(0, D // H, 2) / (D // H))


def rope(x, pos):
    """x (B, H, T, d) rotated by positions pos (B, T)."""
    ang = pos[:, None, :, None].float() * inv
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1).flatten(-2)


def heads(x):
    return x.view(x.shape[0], x.shape[1], H, D // H).transpose(1, 2)


def attend(q, k, v, bias):
    return ((q @ k.transpose(-1, -2)) / (D // H) ** 0.5 + bias).softmax(-1) @ v


class Model(torch.nn.Module):
    def forward(self, tokens, input_pos, cache, bias, write_at):
        return run(tokens, input_pos, cache, bias, write_at)


def run(tokens, input_pos, cache, bias, write_at):
    """tokens (B, T); input_pos (B, T) RoPE positions; cache [(k, v)] per layer, (B, H, columns, d); bias (B, 1, T,
    columns) additive; write_at: the columns (T,) this call writes (a prefill's own square, a decode's ring)."""
    x = emb(tokens)
    for layer in range(LAYERS):
        q, k, v = rope(heads(wq(x)), input_pos), rope(heads(wk(x)), input_pos), heads(wv(x))
        cache[layer][0][:, :, write_at], cache[layer][1][:, :, write_at] = k, v
        if tokens.shape[1] == 1:  # (a fixed query shape: one real query and one of zeros)
            q = torch.cat([q, torch.zeros_like(q)], 2)
        out = attend(q, cache[layer][0], cache[layer][1], bias)[:, :, :tokens.shape[1]]
        x = x + out.transpose(1, 2).reshape(x.shape)
    return head(x)


def reference(ids):
    """One request alone: every layer in a loop, causal, no padding, no cache."""
    x = emb(torch.tensor([ids]))
    pos = torch.arange(len(ids))[None]
    for layer in range(LAYERS):
        q, k, v = rope(heads(wq(x)), pos), rope(heads(wk(x)), pos), heads(wv(x))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
    return head(x)[0]


def prefill(prompt, prefill_lengths):
    size = next(b for b in prefill_lengths if b >= len(prompt))
    tokens = torch.tensor([prompt + [0] * (size - len(prompt))])
    cache = [(torch.zeros(1, H, size, D // H), torch.zeros(1, H, size, D // H)) for _ in range(LAYERS)]
    bias = torch.zeros(size, size).masked_fill(torch.ones(size, size, dtype=torch.bool).triu(1), float("-inf"))
    logits = model(tokens, torch.arange(size)[None], cache, bias[None, None], torch.arange(size))
    return logits[0, len(prompt) - 1], cache


model = Model()


def main():
    prefill_lengths = [4, 8]
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    cache = [(torch.zeros(SLOTS, H, RING, D // H), torch.zeros(SLOTS, H, RING, D // H)) for _ in range(LAYERS)]
    bias = torch.full((SLOTS, RING), float("-inf"))
    pointer, tokens, positions, sampled = 10, [], [], [[] for _ in prompts]
    for slot, prompt in enumerate(prompts):
        first, filled = prefill(prompt, prefill_lengths)
        sampled[slot].append(first)
        columns = (torch.arange(filled[0][0].shape[2]) + pointer - len(prompt)) % RING
        for layer, (k, v) in enumerate(filled):
            cache[layer][0][slot][:, columns], cache[layer][1][slot][:, columns] = k[0], v[0]
        bias[slot] = float("-inf")
        bias[slot, columns[:len(prompt)]] = 0.0
        tokens.append(int(first.argmax()))
        positions.append(len(prompt))
    for _ in range(5):
        bias[:, pointer] = 0.0
        step_bias = bias[:, None, None, :].expand(SLOTS, 1, 2, RING)
        logits = model(torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None], cache, step_bias,
                       torch.tensor([pointer]))
        for slot in range(SLOTS):
            sampled[slot].append(logits[slot, -1])
        tokens = [int(t) for t in logits[:, -1].argmax(-1)]
        positions = [p + 1 for p in positions]
        pointer = (pointer + 1) % RING
    for slot, prompt in enumerate(prompts):
        ids = prompt + [int(s.argmax()) for s in sampled[slot][:-1]]
        want = reference(ids)[len(prompt) - 1:]
        assert torch.allclose(torch.stack(sampled[slot]), want, atol=1e-4), (slot, (torch.stack(sampled[slot]) - want).abs().max())
    print("every slot's logits match its request run alone")


with torch.no_grad():
    main()
