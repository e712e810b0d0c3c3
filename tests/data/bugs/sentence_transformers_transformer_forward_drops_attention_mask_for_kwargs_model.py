# huggingface/sentence-transformers#3509 (commit 560cc336): Transformer.forward passed only the features named in
# inspect.signature(auto_model.forward); a (remote-code) model declaring forward(self, input_ids, **kwargs) silently lost attention_mask.
import inspect
import sys
import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EmbedderModel(torch.nn.Module):
    """Stand-in for a trust_remote_code embedding model that forwards **kwargs to its encoder."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids, **kwargs):
        return self.encoder(input_ids=input_ids, **kwargs)


class Transformer(torch.nn.Module):
    def __init__(self, auto_model):
        super().__init__()
        self.auto_model = auto_model
        if FIXED:
            model_forward_params = list(inspect.signature(self.auto_model.forward).parameters)
            self.model_forward_params = set(model_forward_params) | {
                "input_ids",
                "attention_mask",
                "token_type_ids",
                "inputs_embeds",
            }

    def forward(self, features, **kwargs):
        """Returns token_embeddings, cls_token"""
        if not FIXED:
            # Get the signature of the auto_model's forward method to pass only the expected arguments from `features`
            model_forward_params = list(inspect.signature(self.auto_model.forward).parameters)
            trans_features = {key: value for key, value in features.items() if key in model_forward_params}
        else:
            trans_features = {key: value for key, value in features.items() if key in self.model_forward_params}

        outputs = self.auto_model(**trans_features, **kwargs, return_dict=True)
        token_embeddings = outputs[0]
        features["token_embeddings"] = token_embeddings
        return features


class Pooling(torch.nn.Module):  # pooling_mode="mean"
    def forward(self, features):
        token_embeddings = features["token_embeddings"]
        attention_mask = features["attention_mask"]
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        features["sentence_embedding"] = sum_embeddings / sum_mask
        return features


config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
model = torch.nn.Sequential(Transformer(EmbedderModel(config).eval()), Pooling())

PAD = 0
seqs = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 3], [2, 13, 14, 3]]
L = max(len(s) for s in seqs)
features = {
    "input_ids": torch.tensor([s + [PAD] * (L - len(s)) for s in seqs]),
    "token_type_ids": torch.zeros(len(seqs), L, dtype=torch.long),
    "attention_mask": torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs]),
}
with torch.no_grad():
    emb = model(features)["sentence_embedding"]
    alone = {"input_ids": torch.tensor([seqs[1]]), "token_type_ids": torch.zeros(1, len(seqs[1]), dtype=torch.long),
             "attention_mask": torch.ones(1, len(seqs[1]), dtype=torch.long)}
    emb_alone = model(alone)["sentence_embedding"]
diff = (emb[1] - emb_alone[0]).abs().max().item()
print(f"max |mean-pooled embedding (batched, padded) - (alone)| for the short text: {diff:.6f}")
