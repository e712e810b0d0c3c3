# The same bug as sentence-transformers#3767 (CLS pooling at `token_embeddings[:, 0]` of a left-padded batch), written
# as a DPR-style bi-encoder: one nn.Module holds a question tower and a passage tower (two BertModels, eager
# attention) and pools both inside its own forward, so the pooled read happens inside the outermost module call. The
# tokenizer's settings are a dict that pads on the left (as a decoder-first codebase's shared tokenizer does), so the
# shorter rows' position 0 is [PAD]. The fix pools each row at its first real token (`attention_mask.argmax(1)`).
import sys

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

TOKENIZER = {"padding_side": "left", "pad_token_id": 0, "cls_token_id": 101 % 90, "sep_token_id": 102 % 90}
RETRIEVER = {"pooling": "cls", "temperature": 0.05}


def tokenize(batch_of_ids, settings=TOKENIZER):
    rows = [[settings["cls_token_id"], *ids, settings["sep_token_id"]] for ids in batch_of_ids]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), settings["pad_token_id"], dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if settings["padding_side"] == "left" else slice(0, len(row))
        input_ids[i, span] = torch.tensor(row)
        attention_mask[i, span] = 1
    return input_ids, attention_mask


class BiEncoder(torch.nn.Module):
    def __init__(self, config, retriever):
        super().__init__()
        self.question_encoder = BertModel(config, add_pooling_layer=False)
        self.ctx_encoder = BertModel(config, add_pooling_layer=False)
        self.retriever = retriever

    def pool(self, output, attention_mask):
        hidden = output.last_hidden_state
        if FIXED:
            first = attention_mask.argmax(dim=1)
            return hidden[torch.arange(hidden.size(0)), first]
        return hidden[:, 0, :]  # the [CLS] vector, as if every row began at position 0

    def forward(self, q_ids, q_mask, ctx_ids, ctx_mask):
        q = self.pool(self.question_encoder(input_ids=q_ids, attention_mask=q_mask), q_mask)
        c = self.pool(self.ctx_encoder(input_ids=ctx_ids, attention_mask=ctx_mask), ctx_mask)
        scores = F.normalize(q, dim=-1) @ F.normalize(c, dim=-1).T / self.retriever["temperature"]
        return F.cross_entropy(scores, torch.arange(q.size(0)))


config = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, pad_token_id=0)
config._attn_implementation = "eager"
model = BiEncoder(config, RETRIEVER).eval()

questions = [[12, 40, 7], [33, 5, 18, 61, 9, 22], [70, 3]]
passages = [[12, 40, 7, 55, 21, 8, 19], [33, 5, 18, 61], [70, 3, 44, 16, 28]]
q_ids, q_mask = tokenize(questions)
c_ids, c_mask = tokenize(passages)
with torch.no_grad():
    loss = model(q_ids, q_mask, c_ids, c_mask)
print(f"fixed={FIXED} nll={loss.item():.6f}")
