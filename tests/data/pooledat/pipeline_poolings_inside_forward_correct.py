# Correct poolings done inside a module that wraps the model (a sentence-transformers-like pipeline), so each pooled
# read happens inside the outermost module call: CLS pooling at [:, 0] of a right-padded BERT batch (every row begins
# with its [CLS]), last-token pooling at [:, -1] of a left-padded Llama batch (every row ends with its last token),
# first-real-token pooling by argmax on a left-padded batch, and a mean over the mask. Nothing is read at padding.
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

torch.manual_seed(0)


def batch(rows, side):
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return {"input_ids": ids, "attention_mask": mask}


class Pipeline(torch.nn.Module):
    def __init__(self, model, pooling):
        super().__init__()
        self.model, self.pooling = model, pooling

    def forward(self, features):
        hidden = self.model(**features).last_hidden_state
        mask = features["attention_mask"]
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "lasttoken":
            return hidden[:, -1]
        if self.pooling == "first":
            return hidden[torch.arange(hidden.size(0)), mask.argmax(1)]
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


bert_config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32)
bert_config._attn_implementation = "eager"
llama_config = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
llama_config._attn_implementation = "sdpa"
bert, llama = BertModel(bert_config, add_pooling_layer=False).eval(), LlamaModel(llama_config).eval()
rows = [[1, 7, 9, 11, 2], [1, 4, 2], [1, 5, 6, 8, 13, 17, 2]]
with torch.no_grad():
    cls = Pipeline(bert, "cls")(batch(rows, "right"))
    mean = Pipeline(bert, "mean")(batch(rows, "right"))
    last = Pipeline(llama, "lasttoken")(batch(rows, "left"))
    first = Pipeline(llama, "first")(batch(rows, "left"))
print("pooled", tuple(cls.shape), tuple(mean.shape), tuple(last.shape), tuple(first.shape))
