# Correct: a small encoder-decoder (SDPA) trained on a batch dict whose decoder prompts are left-padded, its
# `decoder_attention_mask` handed to the model with its `decoder_input_ids`. Then, in the same function, a greedy loop
# encodes the sources once and decodes fresh sequences from the start token (no padding: every generated token is real) and, as HF's generate does,
# hands no decoder_attention_mask. The batch's mask describes the batch's decoder tokens, not the loop's: nothing is
# withheld, even at the step where the loop's sequences are as long as the batch's.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
PAD, START = 0, 1


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.q, self.kv = heads, nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x, memory, keep):
        k, v = self.kv(memory).chunk(2, -1)
        o = F.scaled_dot_product_attention(self.split(self.q(x)), self.split(k), self.split(v), attn_mask=keep)
        return x + o.transpose(1, 2).flatten(2)


class Seq2Seq(nn.Module):
    def __init__(self, vocab=20, dim=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder_self, self.decoder_self, self.cross = (Attention(dim, heads) for _ in range(3))
        self.out = nn.Linear(dim, vocab)

    def encode(self, input_ids, attention_mask):
        src = self.embed(input_ids)
        return self.encoder_self(src, src, attention_mask.bool()[:, None, None, :])

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None):
        src_keep = attention_mask.bool()[:, None, None, :]
        memory = self.encode(input_ids, attention_mask) if encoder_outputs is None else encoder_outputs
        tgt = self.embed(decoder_input_ids)
        n = tgt.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        if decoder_attention_mask is not None:
            keep = keep & decoder_attention_mask.bool()[:, None, None, :]
            keep = keep | torch.eye(n, dtype=torch.bool)  # (a padded query keeps its own key: no empty row)
        h = self.decoder_self(tgt, tgt, keep)
        return self.out(self.cross(h, memory, src_keep))


def main():
    model = Seq2Seq()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9], [4, 3, 2, 9, 8]]),
             "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "decoder_input_ids": torch.tensor([[START, 11, 12, 13], [PAD, START, 14, 15]]),
             "decoder_attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]),
             "labels": torch.tensor([[11, 12, 13, 2], [-100, 14, 15, 2]])}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"],
                   decoder_attention_mask=batch["decoder_attention_mask"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    optimizer.step()

    model.eval()
    with torch.no_grad():
        encoder_outputs = model.encode(batch["input_ids"], batch["attention_mask"])  # once, as generate() does
        ys = torch.full((2, 1), START)
        for _ in range(4):
            logits = model(attention_mask=batch["attention_mask"], decoder_input_ids=ys, encoder_outputs=encoder_outputs)
            ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], 1)
    print("loss %.4f, greedy %s" % (loss.item(), ys.tolist()))


main()
