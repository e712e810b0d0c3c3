"""A decoder that samples with a KV cache, then checks each token again by recomputing the whole buffer (written here,
after CodeGeeX's inference loop, not copied from it).

The mask is True = hidden, subtracted from the scores times 1e4 (an additive mask, as Megatron-era code does). In the
recompute pass the model is handed the whole fixed-length buffer and the length of the context so far; the attention
marks every query at or past that length as hidden from every key, so those rows are shifted as a whole and attend
everywhere, and the loop reads only the logits of the context's last query. Correct: the recomputed tokens are the
cached loop's (asserted at the end).
"""

import torch
import torch.nn as nn

torch.manual_seed(0)
VOCAB, DIM, HEADS, BUFFER = 32, 16, 2, 12


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, attention_mask, past=None, context_length=None):
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5
        total = k.shape[2]
        attention_mask = attention_mask[..., total - length:total, :total]
        if context_length is not None:  # (the rows past the context are given up: only the context's last is read)
            attention_mask = attention_mask.clone()
            attention_mask[:, :, context_length:, :] = True
        weights = self.softmax(scores - attention_mask.float() * 10000.0)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, length, DIM)), (k, v)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(BUFFER, DIM)
        self.layers = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attention_mask, past=None, context_length=None):
        x = self.embed(tokens) + self.position(positions)
        present = []
        for n, layer in enumerate(self.layers):
            y, kv = layer(x, attention_mask, None if past is None else past[n], context_length)
            x = x + y
            present.append(kv)
        return self.head(x), present


def main():
    model = Decoder().eval()
    hidden = torch.triu(torch.ones(BUFFER, BUFFER, dtype=torch.bool), diagonal=1)[None, None]
    prompt = torch.randint(1, VOCAB, (2, 5))
    buffer = torch.zeros(2, BUFFER, dtype=torch.long)
    buffer[:, :5] = prompt
    with torch.no_grad():
        logits, past = model(prompt, torch.arange(5)[None], hidden)
        cached = []
        for at in range(5, 9):
            token = logits[:, -1].argmax(-1)
            cached.append(token)
            buffer[:, at] = token
            logits, past = model(token[:, None], torch.tensor([[at]]), hidden, past)
        again = []
        for context in range(5, 9):  # (the whole buffer recomputed, each time with a longer context)
            logits, _ = model(buffer, torch.arange(BUFFER)[None], hidden, context_length=context)
            again.append(logits[:, context - 1].argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(cached, again)), (cached, again)
    print("tokens", torch.stack(cached, 1).tolist(), "recomputed alike")


if __name__ == "__main__":
    main()
