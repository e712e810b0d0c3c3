# A masked-LM pretraining batch that drops the attention mask (the bug of deepchem/deepchem#3597 written another way):
# a DataLoader collate_fn pads the tokenized texts on the left with the tokenizer's pad id, masks 15% of the tokens
# and returns {"input_ids", "labels"} only, so DistilBertForMaskedLM attends to <pad> in every shorter row. The fix
# returns the padding's `attention_mask` too.
import sys

import torch
from torch.utils.data import DataLoader
from transformers import DistilBertConfig, DistilBertForMaskedLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class WordPieceStandIn:
    """A tokenizer's ids and specials: [PAD]=0, [CLS]=101, [SEP]=102, [MASK]=103 (bert-base-uncased's)."""

    pad_token_id, cls_token_id, sep_token_id, mask_token_id = 0, 101, 102, 103

    def encode(self, text):
        return [self.cls_token_id] + [110 + (ord(c) % 80) for c in text.replace(" ", "")] + [self.sep_token_id]


tokenizer = WordPieceStandIn()


def collate(texts):
    ids = [torch.tensor(tokenizer.encode(t)) for t in texts]
    longest = max(len(x) for x in ids)
    input_ids = torch.stack([torch.cat([torch.full((longest - len(x),), tokenizer.pad_token_id), x]) for x in ids])
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    labels = input_ids.clone()
    chosen = (torch.rand(input_ids.shape) < 0.15) & (input_ids > tokenizer.mask_token_id)
    labels[~chosen] = -100
    input_ids = input_ids.masked_fill(chosen, tokenizer.mask_token_id)
    batch = {"input_ids": input_ids, "labels": labels}
    if FIXED:
        batch["attention_mask"] = attention_mask
    return batch


config = DistilBertConfig(vocab_size=200, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                          dropout=0.0, attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id)
model = DistilBertForMaskedLM(config)
corpus = ["the cat sat on the mat", "a dog", "proteins fold into shapes"]
loader = DataLoader(corpus, batch_size=3, collate_fn=collate)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

model.train()
for batch in loader:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"mlm loss: {loss.item():.4f}")
