# huggingface/sentence-transformers#3767 (fixes issue #3208), commit 81517500
# Pooling(pooling_mode="cls") took token_embeddings[:, 0] for every row, assuming right padding.
# With a left-padding tokenizer (e.g. LlamaTokenizer) the shorter rows start with [PAD], so the
# sentence embedding was the hidden state of a pad position instead of the first real token.
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Transformer(torch.nn.Module):
    def __init__(self, model, module_output_name="token_embeddings"):
        super().__init__()
        self.model = model
        self.module_output_name = module_output_name
        self.model_forward_params = set(inspect.signature(self.model.forward).parameters)

    def forward(self, features, **kwargs):
        all_kwargs = {**features, **kwargs, "return_dict": True}
        filtered_kwargs = {key: value for key, value in all_kwargs.items() if key in self.model_forward_params}
        model_output = self.model(**filtered_kwargs)
        features[self.module_output_name] = model_output["last_hidden_state"]
        return features


class Pooling(torch.nn.Module):
    POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")

    def __init__(self, embedding_dimension, pooling_mode="mean", include_prompt=True):
        super().__init__()
        self.embedding_dimension = embedding_dimension
        self.pooling_mode = pooling_mode
        self.include_prompt = include_prompt

    def forward(self, features, **kwargs):
        token_embeddings = features["token_embeddings"]
        if "attention_mask" in features and features["attention_mask"].size(-1) == token_embeddings.size(1):
            attention_mask = features["attention_mask"]
        else:
            attention_mask = torch.ones(token_embeddings.shape[:-1], device=token_embeddings.device, dtype=torch.int64)
        output_vectors = self._forward_padded(token_embeddings, attention_mask, features)
        features["sentence_embedding"] = torch.cat(output_vectors, dim=-1)
        return features

    def _forward_padded(self, token_embeddings: Tensor, attention_mask: Tensor, features) -> list[Tensor]:
        modes = (self.pooling_mode,) if isinstance(self.pooling_mode, str) else self.pooling_mode
        output_vectors: list[Tensor] = []
        for mode in modes:
            if mode == "cls":
                if FIXED:
                    if "cls_token_embeddings" in features:
                        output_vectors.append(features["cls_token_embeddings"])
                    else:
                        hidden_dim = token_embeddings.shape[-1]
                        first_indices = attention_mask.to(torch.int).argmax(dim=1)
                        gather_indices = first_indices.unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden_dim)
                        output_vectors.append(torch.gather(token_embeddings, 1, gather_indices).squeeze(1))
                else:
                    output_vectors.append(features.get("cls_token_embeddings", token_embeddings[:, 0]))
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(token_embeddings.dtype)
                mean_sum = (token_embeddings * mask).sum(dim=1)
                mean_mask = torch.clamp(mask.sum(dim=1), min=1e-9)
                output_vectors.append(mean_sum / mean_mask if mode == "mean" else mean_sum / torch.sqrt(mean_mask))
        return output_vectors


class Normalize(torch.nn.Module):
    def forward(self, features):
        features["sentence_embedding"] = F.normalize(features["sentence_embedding"], p=2, dim=1)
        return features


class Tokenizer:
    """Left-padding tokenizer, as LlamaTokenizer pads by default."""

    padding_side = "left"

    def __init__(self, vocab_size, pad_token_id=0, bos_token_id=1):
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id

    def __call__(self, texts):
        ids = [[3 + (ord(c) % (self.vocab_size - 3)) for c in t] for t in texts]
        max_len = max(len(x) for x in ids)
        input_ids, attention_mask = [], []
        for x in ids:
            pad = max_len - len(x)
            input_ids.append([self.pad_token_id] * pad + x)
            attention_mask.append([0] * pad + [1] * len(x))
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
config._attn_implementation = "sdpa"
auto_model = LlamaModel(config).eval()
tokenizer = Tokenizer(config.vocab_size)
model = torch.nn.Sequential(Transformer(auto_model), Pooling(64, pooling_mode="cls"), Normalize())


def encode(texts):
    features = tokenizer(texts)
    return model(features)["sentence_embedding"]


queries = ["what is a mask", "padding side left", "cls pooling"]
documents = [
    "an attention mask says which tokens attend to which others",
    "llama tokenizers pad on the left by default",
    "the first token of a sequence is pooled as the sentence embedding",
]

# MultipleNegativesRankingLoss, as in a sentence-transformers training step
with torch.no_grad():
    q = encode(queries)
    d = encode(documents)
    scores = q @ d.T * 20.0
    loss = F.cross_entropy(scores, torch.arange(len(queries)))
print(f"fixed={FIXED} mnrl_loss={loss.item():.6f} q_norm_sum={q.sum().item():.6f}")
