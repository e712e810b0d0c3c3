"""A detector's decoder (quiet): 6 object queries attend each other, then a memory of the text prompt joined with
box prompts; the text's attention_mask counts 6 tokens too.

The model call is handed the text ids and their attention_mask (6 columns, right-padded) beside box prompts. Its
decoder layer runs a self-attention over its own 6 learned object queries (no padding: every query is real) and a
cross-attention whose keys are the text's 6 tokens followed by 2 box tokens, masked by the text's padding. The
self-attention's 6 tokens are the object queries, not the text, though they count as many. Self-check: each sample
alone, its text unpadded, gives the same decoder output.
"""
import torch

torch.manual_seed(0)
D, H, QUERIES, V = 16, 2, 6, 40


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))

    def forward(self, x, memory, keep=None):
        b = x.shape[0]
        q = self.q(x).view(b, -1, H, D // H).transpose(1, 2)
        k, v = (f(memory).view(b, -1, H, D // H).transpose(1, 2) for f in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        return x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)


class DecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(), Attention()

    def forward(self, queries, memory, memory_keep):
        return self.cross_attn(self.self_attn(queries, queries), memory, memory_keep)


class Detector(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.box = torch.nn.Embedding(V, D), torch.nn.Linear(4, D)
        self.object_queries = torch.nn.Parameter(torch.randn(QUERIES, D))
        self.layers = torch.nn.ModuleList(DecoderLayer() for _ in range(2))

    def forward(self, input_ids, attention_mask, boxes):
        memory = torch.cat([self.embed(input_ids), self.box(boxes)], 1)
        keep = torch.cat([attention_mask.bool(), torch.ones(boxes.shape[:2], dtype=torch.bool)], 1)
        x = self.object_queries.expand(input_ids.shape[0], -1, -1)
        for layer in self.layers:
            x = layer(x, memory, keep)
        return x


model = Detector().eval()
texts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
ids = torch.tensor([t + [0] * (6 - len(t)) for t in texts])
mask = (ids != 0).long()
boxes = torch.rand(2, 2, 4)
with torch.no_grad():
    out = model(ids, attention_mask=mask, boxes=boxes)
    for row, text in enumerate(texts):
        alone = model(torch.tensor([text]), attention_mask=torch.ones(1, len(text)), boxes=boxes[row:row + 1])
        assert torch.allclose(out[row], alone[0], atol=1e-5), row
print("every sample matches its text alone")
