# A correct encoder (MPNet's fairseq port written small, quiet-zx): its attention folds the heads into the batch, (B * H,
# L, L), as fairseq's MultiheadAttention does, masking padded keys by `key_padding_mask`. main() holds the batch's
# `lengths` ([9, 4, 6, 3]: 4 sentences) and, checking itself, runs each sentence alone, unpadded: those calls are
# (1 * 4 heads, L, L) over the sentence's own L keys with no mask, as many rows as the batch has sentences. Each
# sentence's features alone equal its row of the padded batch.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
PAD = 1


class Encoder(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.in_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, src_tokens):
        b, n = src_tokens.shape
        x = self.emb(src_tokens)
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        fold = lambda t: t.view(b, n, self.heads, -1).transpose(1, 2).reshape(b * self.heads, n, -1)  # noqa: E731
        q, k, v = fold(q), fold(k), fold(v)
        scores = torch.bmm(q, k.transpose(1, 2)) / q.shape[-1] ** 0.5
        padding = src_tokens.eq(PAD)
        if padding.any():
            scores = scores.view(b, self.heads, n, n).masked_fill(padding[:, None, None, :], float("-inf"))
            scores = scores.view(b * self.heads, n, n)
        out = torch.bmm(F.softmax(scores, dim=-1), v).view(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.out_proj(out)


def main():
    model = Encoder().eval()
    lengths = [9, 4, 6, 3]
    sentences = [torch.randint(2, 30, (n,)) for n in lengths]
    src_tokens = torch.full((len(lengths), max(lengths)), PAD)
    for row, sentence in enumerate(sentences):
        src_tokens[row, :len(sentence)] = sentence
    with torch.no_grad():
        features = model(src_tokens)
        for row, sentence in enumerate(sentences):
            alone = model(sentence[None])
            assert torch.allclose(features[row, :lengths[row]], alone[0], atol=1e-5)
    print("each sentence alone equals its row of the padded batch")


if __name__ == "__main__":
    main()
