# allennlp, allenai/allennlp#3465 (fixed by PR allenai/allennlp#3560): PretrainedTransformerEmbedder called the
# transformer with token ids only, so padded wordpieces of shorter instances were attended to by every real token.
import sys
import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PretrainedTransformerEmbedder(torch.nn.Module):
    """allennlp/modules/token_embedders/pretrained_transformer_embedder.py (0.9.x); random weights instead of
    AutoModel.from_pretrained(model_name)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.transformer_model = BertModel(config)
        self.output_dim = self.transformer_model.config.hidden_size

    def get_output_dim(self):
        return self.output_dim

    if FIXED:
        def forward(self, token_ids: torch.LongTensor, mask: torch.LongTensor) -> torch.Tensor:  # type: ignore
            return self.transformer_model(input_ids=token_ids, attention_mask=mask)[0]
    else:
        def forward(self, token_ids: torch.LongTensor) -> torch.Tensor:  # type: ignore
            return self.transformer_model(token_ids)[0]


class PretrainedTransformerIndexer:
    """Turns wordpiece id lists into the padded tensor dict handed to the embedder."""

    def tokens_to_indices(self, wordpiece_ids):
        if FIXED:
            # The mask has 1 for real tokens and 0 for padding tokens. Only real tokens are attended to.
            return {"token_ids": wordpiece_ids, "mask": [1] * len(wordpiece_ids)}
        return {"token_ids": wordpiece_ids}

    def as_padded_tensor_dict(self, batch_indices, pad_id=0):
        seq = max(len(ix["token_ids"]) for ix in batch_indices)
        out = {}
        for key in batch_indices[0]:
            fill = pad_id if key == "token_ids" else 0
            out[key] = torch.tensor([ix[key] + [fill] * (seq - len(ix[key])) for ix in batch_indices])
        return out


class BasicTextFieldEmbedder(torch.nn.Module):
    """Passes each indexer's tensor dict to its token embedder as keyword arguments."""

    def __init__(self, token_embedders):
        super().__init__()
        self._token_embedders = torch.nn.ModuleDict(token_embedders)

    def forward(self, text_field_input):
        outputs = []
        for key, embedder in self._token_embedders.items():
            tensors = text_field_input[key]
            outputs.append(embedder(**tensors))
        return torch.cat(outputs, dim=-1)


config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=0)
embedder = BasicTextFieldEmbedder({"bert": PretrainedTransformerEmbedder(config)}).eval()

# two instances of different length: [CLS]=2 ... [SEP]=3, padded with id 0 by the indexer
indexer = PretrainedTransformerIndexer()
lengths = [10, 6]
instances = []
for n in lengths:
    ids = torch.randint(5, 100, (n,)).tolist()
    ids[0], ids[-1] = 2, 3
    instances.append(indexer.tokens_to_indices(ids))

with torch.no_grad():
    batched = embedder({"bert": indexer.as_padded_tensor_dict(instances)})
    alone = embedder({"bert": indexer.as_padded_tensor_dict(instances[1:])})
print("max |batched - alone| on the real wordpieces of the shorter instance:",
      (batched[1, :6] - alone[0]).abs().max().item())
