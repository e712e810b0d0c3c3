"""A continuous-batching engine that packs each step's requests into one row, each over its own cache (quiet).

Every step schedules some requests and packs their new tokens one after another into a single row; the keys are each
request's cached keys then its new ones, request after request, and the mask is causal within each request's block and
empty across requests. Two requests of 2 new tokens make a step of 4 queries; two new requests of 4 tokens make a step
of 8 (each block of 4 sees its own tokens causally, as a request run alone does); later steps decode one token of each.
Self-check: every request run alone in one causal pass gives the logits the engine sampled from.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, V = 16, 2, 40
emb = torch.nn.Embedding(V, D)
pos_emb = torch.nn.Embedding(64, D)
qkv = torch.nn.Linear(D, 3 * D)
head = torch.nn.Linear(D, V)


class Model(torch.nn.Module):
    def forward(self, ids, positions, caches, news):
        """ids (1, T) packed; positions (1, T); caches: each request's (k, v) of (H, cached, d); news: new tokens each."""
        x = emb(ids) + pos_emb(positions)
        q, k, v = qkv(x)[0].view(-1, 3, H, D // H).permute(1, 2, 0, 3)  # each (H, T, d)
        keys, values, blocks, start = [], [], [], 0
        for (ck, cv), n in zip(caches, news):
            keys += [ck, k[:, start:start + n]]
            values += [cv, v[:, start:start + n]]
            blocks.append((ck.shape[1], n))
            start += n
        total = sum(c + n for c, n in blocks)
        mask = torch.zeros(sum(news), total, dtype=torch.bool)
        row = col = 0
        for cached, n in blocks:
            mask[row:row + n, col:col + cached + n] = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
            row, col = row + n, col + cached + n
        y = F.scaled_dot_product_attention(q[None], torch.cat(keys, 1)[None], torch.cat(values, 1)[None], attn_mask=mask)
        out, start = [], 0
        for i, n in enumerate(news):  # (each request's cache grows by its new keys)
            caches[i] = (torch.cat([caches[i][0], k[:, start:start + n]], 1), torch.cat([caches[i][1], v[:, start:start + n]], 1))
            start += n
        return head(x + y[0].transpose(0, 1).reshape(1, -1, D))


def main():
    model = Model()
    empty = (torch.zeros(H, 0, D // H), torch.zeros(H, 0, D // H))
    requests = {0: [3, 4], 1: [5, 6], 2: [7, 8, 9, 10], 3: [11, 12, 13, 14]}
    caches, tokens, logits = {}, {r: list(p) for r, p in requests.items()}, {r: [] for r in requests}
    schedule = [[0, 1], [2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [2, 3]]
    for step in schedule:
        ids, positions, news = [], [], []
        for r in step:
            new = tokens[r] if r not in caches else tokens[r][-1:]
            caches.setdefault(r, empty)
            start = caches[r][0].shape[1]
            ids += new
            positions += list(range(start, start + len(new)))
            news.append(len(new))
        held = [caches[r] for r in step]
        out = model(torch.tensor([ids]), torch.tensor([positions]), held, news)
        for r, cache in zip(step, held):
            caches[r] = cache
        end = 0
        for r, n in zip(step, news):
            end += n
            logits[r].append(out[0, end - 1])
            tokens[r].append(int(out[0, end - 1].argmax()))
    for r, prompt in requests.items():
        ids = torch.tensor([tokens[r][:-1]])
        x = emb(ids) + pos_emb(torch.arange(ids.shape[1])[None])
        q, k, v = qkv(x)[0].view(-1, 3, H, D // H).permute(1, 2, 0, 3)
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
        want = head(x + y[0].transpose(0, 1).reshape(1, -1, D))[0, len(prompt) - 1:]
        assert torch.allclose(torch.stack(logits[r]), want, atol=1e-4), (r, (torch.stack(logits[r]) - want).abs().max())
    print("every request's logits match the request run alone")


with torch.no_grad():
    main()
