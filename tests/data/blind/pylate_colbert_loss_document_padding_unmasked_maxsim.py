# Citation: lightonai/pylate (then named giga_cherche), commit 4a603d5b686c26d7280a7c2c8d52ddf69ea6dc34
#   "Adding masks for document scoring (and fixing the document during eval being processed as queries"
#   parent 4a603d5^ is the code before the fix.
# Upstream: giga_cherche/losses/ColBERTLoss.py (ColBERTSimilarityMetric.COLBERT_SIMILARITY, ColBERTLoss.forward),
#   giga_cherche/models/colbert.py (ColBERT.tokenize: queries padded to 32 with [MASK] and fully attended,
#   documents padded to the longest with a 0 attention mask; pad_token_id is set to [MASK] for both), giga_cherche/ColBERTDataCollator.py,
#   giga_cherche/models/LinearProjection.py, sentence-transformers models.Transformer.
# Bug: during training the late-interaction (MaxSim) score took the max over every document token position,
#   including the [PAD] positions of the padded document batch; their token embeddings are real encoder outputs
#   (not zeros), so a padding position can win the max for a query token and enters the contrastive loss.
# Fix: ColBERTLoss.forward collects each column's attention_mask and COLBERT_SIMILARITY(x, y, mask) sets the
#   similarities at document positions whose mask is 0 to -inf before the max over document tokens.
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- tokenizer stand-in (BERT-like vocab)
class TinyWordPieceTokenizer:
    pad_token_id = 0
    cls_token_id = 1
    sep_token_id = 2
    mask_token_id = 3
    vocab_size = 64

    def __init__(self):
        self.vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3, "[unused0]": 4, "[unused1]": 5, ".": 6}

    def convert_tokens_to_ids(self, tok):
        return self.vocab[tok]

    def _word_id(self, w):
        if w in self.vocab:
            return self.vocab[w]
        return 7 + (sum(ord(c) * (i + 1) for i, c in enumerate(w)) % (self.vocab_size - 7))

    def __call__(self, texts, padding=True, max_length=64):
        ids = [[self.cls_token_id] + [self._word_id(w) for w in t.split()][: max_length - 2] + [self.sep_token_id] for t in texts]
        if padding == "max_length":
            L = max_length
        else:
            L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), L), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
            attention_mask[i, : len(x)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": torch.zeros_like(input_ids),
        }


# ---------------------------------------------------------------- sentence_transformers.models.Transformer
class Transformer(nn.Module):
    def __init__(self, auto_model, tokenizer, max_seq_length=64):
        super().__init__()
        self.auto_model = auto_model
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length

    def forward(self, features):
        trans_features = {"input_ids": features["input_ids"], "attention_mask": features["attention_mask"]}
        if "token_type_ids" in features:
            trans_features["token_type_ids"] = features["token_type_ids"]
        output_states = self.auto_model(**trans_features, return_dict=False)
        output_tokens = output_states[0]
        features.update({"token_embeddings": output_tokens, "attention_mask": features["attention_mask"]})
        return features

    def tokenize(self, texts, padding=True):
        return self.tokenizer(texts, padding=padding, max_length=self.max_seq_length)


# ---------------------------------------------------------------- giga_cherche/models/LinearProjection.py
class LinearProjection(nn.Module):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.linear_projection = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, features: Dict[str, Tensor]):
        token_embeddings = features["token_embeddings"]
        projected_embeddings = self.linear_projection(token_embeddings)
        features["token_embeddings"] = projected_embeddings
        return features


# ---------------------------------------------------------------- giga_cherche/models/colbert.py (ColBERT)
class ColBERT(nn.Sequential):
    def __init__(self, modules, query_prefix="[unused0]", document_prefix="[unused1]"):
        super().__init__(*modules)
        self.tokenizer = modules[0].tokenizer
        self.query_prefix_id = self.tokenizer.convert_tokens_to_ids(query_prefix)
        self.document_prefix_id = self.tokenizer.convert_tokens_to_ids(document_prefix)
        # We are using the mask token as the padding token for padding queries
        self.tokenizer.pad_token_id = self.tokenizer.mask_token_id

    def _first_module(self):
        return self[0]

    def tokenize(self, texts, is_query=True):
        # Add placeholder for the document/query prefix
        texts = [". " + text for text in texts]
        if is_query:
            features = self._first_module().tokenize(texts, padding="max_length")
            features["input_ids"][:, 1] = self.query_prefix_id
            # Since we cannot feed a target size to the tokenize function, truncate to query_max_seq_length
            features["input_ids"] = features["input_ids"][:, :32]
            features["attention_mask"] = features["attention_mask"][:, :32]
            features["token_type_ids"] = features["token_type_ids"][:, :32]
            # Fill the attention mask with ones (we attend to "padding" tokens)
            features["attention_mask"].fill_(1)
            return features
        else:
            features = self._first_module().tokenize(texts)
            # Remplace the second token by the document prefix
            features["input_ids"][:, 1] = self.document_prefix_id
            return features


# ---------------------------------------------------------------- giga_cherche/ColBERTDataCollator.py
@dataclass
class ColBERTDataCollator:
    tokenize_fn: Callable
    valid_label_columns: List[str] = field(default_factory=lambda: ["label", "score"])

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        columns = list(features[0].keys())
        batch = {"return_loss": True}
        for column in columns:
            if "query" in column or "anchor" in column:
                tokenized = self.tokenize_fn([row[column] for row in features], is_query=True)
            else:
                tokenized = self.tokenize_fn([row[column] for row in features], is_query=False)
            for key, value in tokenized.items():
                batch[f"{column}_{key}"] = value
        return batch


# ---------------------------------------------------------------- giga_cherche/losses/ColBERTLoss.py
class ColBERTSimilarityMetric:
    """The metric for the contrastive loss"""

    if not FIXED:

        @staticmethod
        def COLBERT_SIMILARITY(x, y):
            # a num_queries, s queries_seqlen, h hidden_size, b num_documents, t documents_seqlen
            # Take make along the t axis (get max similarity for each query tokens), then sum over all the query tokens
            return torch.einsum("ash,bth->abst", x, y).max(axis=3).values.sum(axis=2)

    else:

        @staticmethod
        def COLBERT_SIMILARITY(x, y, mask):
            simis = torch.einsum("ash,bth->abst", x, y)
            expanded_mask = mask.unsqueeze(0).unsqueeze(2)
            expanded_mask = expanded_mask.expand(simis.size(0), -1, simis.size(2), -1)
            simis[expanded_mask == 0] = float("-inf")
            return simis.max(axis=3).values.sum(axis=2)


class ColBERTLoss(nn.Module):
    def __init__(self, model, distance_metric=ColBERTSimilarityMetric.COLBERT_SIMILARITY, size_average=True):
        super().__init__()
        self.distance_metric = distance_metric
        self.model = model
        self.size_average = size_average

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Tensor):
        reps = [self.model(sentence_feature)["token_embeddings"] for sentence_feature in sentence_features]
        if not FIXED:
            distances = torch.cat([self.distance_metric(reps[0], rep) for rep in reps[1:]], dim=1)
        else:
            masks = [sentence_feature["attention_mask"] for sentence_feature in sentence_features]
            distances = torch.cat(
                [self.distance_metric(reps[0], rep, mask) for rep, mask in zip(reps[1:], masks[1:])], dim=1
            )
        labels = torch.arange(0, reps[0].size(0), device=reps[0].device)
        loss = F.cross_entropy(distances, labels, reduction="mean" if self.size_average else "sum")
        return loss, distances


# ---------------------------------------------------------------- sentence-transformers trainer glue
def collect_features(inputs, column_names):
    sentence_features = []
    for column in column_names:
        prefix = f"{column}_"
        sentence_features.append({k[len(prefix):]: v for k, v in inputs.items() if k.startswith(prefix)})
    return sentence_features


def main():
    tok = TinyWordPieceTokenizer()
    cfg = BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    bert = BertModel(cfg, add_pooling_layer=False)
    model = ColBERT([Transformer(bert, tok), LinearProjection(32, 16, bias=False)])
    loss_fn = ColBERTLoss(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    rows = [
        {"anchor": "what is the capital of france", "positive": "paris is the capital and largest city of france",
         "negative": "berlin"},
        {"anchor": "who wrote hamlet", "positive": "hamlet",
         "negative": "the tragedy of macbeth was written by william shakespeare around the year 1606 in london"},
        {"anchor": "boiling point of water", "positive": "water boils at one hundred degrees celsius at sea level",
         "negative": "ice melts"},
        {"anchor": "largest planet", "positive": "jupiter",
         "negative": "mars is a small rocky planet that is often called the red planet by astronomers"},
    ]
    collator = ColBERTDataCollator(tokenize_fn=model.tokenize)
    batch = collator(rows)
    print("document attention mask (positive column):")
    print(batch["positive_attention_mask"])

    model.train()
    for step in range(3):
        feats = collect_features(batch, ["anchor", "positive", "negative"])
        loss, distances = loss_fn(feats, None)
        optim.zero_grad()
        loss.backward()
        optim.step()
        print(f"step {step}: loss = {loss.item():.6f}")
    print("scores (query x [positives | negatives]) at last step:")
    print(distances.detach().round(decimals=3))
    print("rank-1 document per query:", distances.argmax(dim=1).tolist())


if __name__ == "__main__":
    main()
