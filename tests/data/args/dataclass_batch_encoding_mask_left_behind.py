"""A tagger's batch is a dataclass holding the tokenizer's output; its forward hands the encoder the ids alone.

Written another way (hopsparser 4e6e5c4, tests/data/blind/hopsparser_bert_lexer_padded_batch_without_attention_mask.py):
the collator right-pads each sentence and keeps the tokenizer's dict, `input_ids` and `attention_mask`, in a
dataclass beside the labels; the tagger's forward takes that batch and runs its bidirectional encoder on
`batch.encoding["input_ids"]` with no key padding mask, so every real token attends the pads of the shorter rows and
its tags change with the batch it is padded into. The fix hands the encoder the batch's own mask.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 0


@dataclass
class TaggerBatch:
    encoding: dict
    labels: torch.Tensor


def collate(sentences: list[list[int]], tags: list[list[int]]) -> TaggerBatch:
    width = max(map(len, sentences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sentences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sentences])
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in tags])
    return TaggerBatch({"input_ids": ids, "attention_mask": mask}, labels)


class Tagger(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, tags: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classify = nn.Linear(dim, tags)

    def forward(self, batch: TaggerBatch) -> torch.Tensor:
        x = self.embed(batch.encoding["input_ids"])
        pad = batch.encoding["attention_mask"] == 0 if FIXED else None
        return self.classify(self.encoder(x, src_key_padding_mask=pad))


def main() -> None:
    torch.manual_seed(0)
    model = Tagger()
    sentences = [[5, 17, 23, 9, 41, 12], [7, 19, 33], [11, 4, 26, 38]]
    tags = [[1, 2, 0, 3, 1, 4], [2, 2, 1], [0, 1, 3, 2]]
    batch = collate(sentences, tags)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        logits = model(batch)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 5), batch.labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(batch).argmax(-1)
    print("loss", round(loss.item(), 4), "tags", [p[: len(s)].tolist() for p, s in zip(predicted, sentences)])


if __name__ == "__main__":
    main()
