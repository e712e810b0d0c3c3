# nyu-mll/jiant#465 "Critical bug: fix sign of BERT attention mask": the BERT embedder built its input_mask
# as (ids == 0), i.e. ones on the padding, so BERT attended to [PAD] and ignored the real wordpieces.
import sys

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class BertEmbedderModule(nn.Module):
    """Wraps a BERT model and exposes its last layer as token embeddings (jiant style)."""

    def __init__(self, config, pad_id=0):
        super().__init__()
        self.model = BertModel(config, add_pooling_layer=False)
        self._pad_id = pad_id

    def forward(self, sent, unused_task_name=""):
        # jiant shifts wordpiece ids by 2 so that 0 is the AllenNLP padding index
        ids = sent["bert_wpm_pretokenized"]
        if FIXED:
            input_mask = (ids != 0).long()
        else:
            input_mask = (ids == 0).long()
        ids = ids.clone()
        ids[ids == 0] = self._pad_id + 2
        ids = ids - 2
        out = self.model(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=input_mask)
        return out.last_hidden_state


class SingleClassifier(nn.Module):
    def __init__(self, d_in, n_classes):
        super().__init__()
        self.proj = nn.Linear(d_in, n_classes)

    def forward(self, word_embs, mask):
        mask = mask.unsqueeze(-1).float()
        pooled = (word_embs * mask).sum(1) / mask.sum(1)
        return self.proj(pooled)


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    embedder = BertEmbedderModule(config).eval()
    clf = SingleClassifier(config.hidden_size, 3).eval()

    # two sentences (already wordpiece-tokenized and shifted by 2), padded with 0 to length 10
    s1 = [3, 17, 25, 9, 40, 4]
    s2 = [3, 11, 12, 13, 14, 15, 16, 18, 19, 4]
    batch = torch.zeros(2, 10, dtype=torch.long)
    batch[0, :len(s1)] = torch.tensor(s1)
    batch[1, :len(s2)] = torch.tensor(s2)
    sent = {"bert_wpm_pretokenized": batch}

    with torch.no_grad():
        embs = embedder(sent)
        logits = clf(embs, batch != 0)
        # reference: the first sentence alone, no padding, nothing to mask
        alone = embedder.model(input_ids=torch.tensor([s1]) - 2,
                               token_type_ids=torch.zeros(1, len(s1), dtype=torch.long)).last_hidden_state
    diff = (embs[0, :len(s1)] - alone[0]).abs().max().item()
    print(f"fixed={FIXED} logits[0]={[round(x, 4) for x in logits[0].tolist()]} "
          f"max |padded - unpadded| on real tokens: {diff:.3e}")


if __name__ == "__main__":
    main()
