"""A correct time-major encoder: `src` is (seq, batch), padded down its columns, and the batch_first=False layer is
handed (seq, batch, embed) with the key padding transposed to (batch, seq). Written for maskcli's tests: the quiet
side of batch-axis-attended (the ids' padding says their rows are positions, and the call's keys are those)."""
import torch
import torch.nn as nn

PAD = 1


class Encoder(nn.Module):
    def __init__(self, vocab=12, dim=8, heads=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.attn = nn.MultiheadAttention(dim, heads)

    def forward(self, src):
        x = self.embeddings(src)  # (S, N, E)
        out, _ = self.attn(x, x, x, key_padding_mask=(src == PAD).transpose(0, 1), need_weights=False)
        return out


if __name__ == "__main__":
    torch.manual_seed(0)
    src = torch.tensor([[4, 7, 2], [5, 8, 3], [6, 9, PAD], [10, PAD, PAD], [11, PAD, PAD]])
    with torch.no_grad():
        out = Encoder().eval()(src)
    print("ok", tuple(out.shape))
