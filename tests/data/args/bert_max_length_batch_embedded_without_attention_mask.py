# Written another way (huggingface/optimum-executorch#230's bug, a static-length encoder run without its mask): a
# sentence-embedding export that pads every text to the exported program's fixed length (`padding="max_length"`), so
# no row of the batch is unpadded, and calls BertModel with the input ids alone; the pad id is BertConfig's 0, the
# texts' own ids never 0. Fix: hand it `attention_mask = (input_ids != pad_token_id)` (and mean-pool over it).
import sys

import torch
from torch import nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SentenceEmbeddingExport(nn.Module):
    """What the exporter traces: ids of a fixed length in, one mean-pooled vector per text out."""

    def __init__(self, bert: BertModel):
        super().__init__()
        self.bert = bert
        self.pad_token_id = bert.config.pad_token_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        keep = (input_ids != self.pad_token_id).long()
        if FIXED:
            hidden = self.bert(input_ids=input_ids, attention_mask=keep).last_hidden_state
        else:
            hidden = self.bert(input_ids=input_ids).last_hidden_state
        weights = keep.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)


def main():
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    bert = BertModel(config, add_pooling_layer=False).eval()
    model = SentenceEmbeddingExport(bert)
    max_length = 12  # the exported program's static input length
    texts = [[2, 14, 33, 7, 3], [2, 21, 9, 45, 18, 11, 6, 3]]
    input_ids = torch.full((len(texts), max_length), config.pad_token_id)
    for row, ids in enumerate(texts):
        input_ids[row, : len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        got = model(input_ids)
        ref = torch.stack([bert(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0) for ids in texts])
    print(f"fixed={FIXED} max |static-length embedding - unpadded| = {(got - ref).abs().max().item():.6f}")


if __name__ == "__main__":
    main()
