# Correct: a bidirectional encoder of feature-map linear attention (elu + 1, fast-transformers' LinearAttention,
# every key summed) trained on a masked-token loss: each masked position's target is its own original id, not the
# next one, so every token may see every other (sees-its-target must stay quiet). Left-padded rows, the padded keys'
# φ(k) zeroed by the attention mask.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
VOCAB, PAD, MASK = 40, 0, 1


class LinearSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x, attention_mask):
        B, L, E = x.shape
        q, k, v = (p(x).view(B, L, self.n_heads, -1) for p in (self.q, self.k, self.v))
        q, k = F.elu(q) + 1, (F.elu(k) + 1) * attention_mask[:, :, None, None]
        kv = torch.einsum("bshd,bshm->bhmd", k, v)
        z = 1 / (torch.einsum("blhd,bhd->blh", q, k.sum(dim=1)) + 1e-6)
        return self.o(torch.einsum("blhd,bhmd,blh->blhm", q, kv, z).reshape(B, L, E))


class Encoder(nn.Module):
    def __init__(self, d_model=32, n_heads=4, n_layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.layers = nn.ModuleList(LinearSelfAttention(d_model, n_heads) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        for layer, norm in zip(self.layers, self.norms):
            x = norm(x + layer(x, attention_mask.float()))
        return self.head(x)


if __name__ == "__main__":
    lengths = (10, 7)
    ids = torch.full((2, 10), PAD)
    mask = torch.zeros(2, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, 10 - n:] = torch.randint(2, VOCAB, (n,))
        mask[b, 10 - n:] = 1
    labels = torch.full_like(ids, -100)
    chosen = torch.tensor([[0, 0, 1, 0, 0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)
    labels[chosen] = ids[chosen]
    inputs = ids.masked_fill(chosen, MASK)
    model = Encoder()
    logits = model(inputs, mask)
    loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
    loss.backward()
    print(f"masked-token loss {loss.item():.4f}")
