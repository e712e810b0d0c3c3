"""Correct program (quiet batch quiet-r89a): a sentence-transformers bi-encoder (Transformer -> Pooling ->
Normalize) encoding prompted queries and plain passages in right-padded batches.

Citation: UKPLab/sentence-transformers @85ec64559f4414aa536eca4bf53538291e0a333f:
sentence_transformers/models/Pooling.py (Pooling.forward: include_prompt=False zeroes attention_mask[:, :prompt_length];
cls / max / mean / mean_sqrt_len / weightedmean / lasttoken modes), sentence_transformers/models/Transformer.py
(Transformer.forward: auto_model(**trans_features)[0] -> token_embeddings), sentence_transformers/models/Normalize.py,
sentence_transformers/SentenceTransformer.py (encode: prompt + sentence, extra_features["prompt_length"];
_get_prompt_length: tokenized prompt length minus a trailing special token).

The tokenizer is a fixed word -> id table with bert-base-uncased special ids (no download); the encoder is a tiny
random BertModel. Self-check: every sentence run alone, unpadded and without an attention mask, and each pooling
mode recomputed by explicit loops over its kept positions (the prompt's positions left out where include_prompt is
False); the batched embeddings must match.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertModel

torch.manual_seed(0)

PAD, CLS, SEP = 0, 101, 102
WORDS = ["query", "passage", ":", "how", "do", "tides", "work", "the", "moon", "pulls", "on", "oceans", "causing",
         "high", "and", "low", "water", "twice", "a", "day", "bake", "bread", "at", "home", "flour", "yeast", "salt",
         "knead", "dough", "rise", "oven", "best", "sourdough", "starter", "in", "?", ".", ","]
VOCAB = {w: 2000 + i for i, w in enumerate(WORDS)}


class Tokenizer:
    pad_token_id = PAD
    all_special_ids = [PAD, CLS, SEP]

    def _ids(self, text):
        return [CLS] + [VOCAB[w] for w in text.replace("?", " ?").replace(".", " .").replace(",", " ,")
                        .replace(":", " :").split()] + [SEP]

    def __call__(self, texts, padding=True, truncation="longest_first", return_tensors="pt", max_length=64):
        ids = [self._ids(t)[:max_length] for t in texts]
        L = max(len(x) for x in ids)
        return {"input_ids": torch.tensor([x + [PAD] * (L - len(x)) for x in ids]),
                "token_type_ids": torch.zeros(len(ids), L, dtype=torch.long),
                "attention_mask": torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in ids])}


class Transformer(nn.Module):
    def __init__(self, auto_model, tokenizer):
        super().__init__()
        self.auto_model = auto_model
        self.tokenizer = tokenizer
        self.model_forward_params = {"input_ids", "attention_mask", "token_type_ids"}

    def forward(self, features: dict[str, Tensor], **kwargs) -> dict[str, Tensor]:
        trans_features = {key: value for key, value in features.items() if key in self.model_forward_params}
        outputs = self.auto_model(**trans_features, **kwargs, return_dict=True)
        token_embeddings = outputs[0]
        features["token_embeddings"] = token_embeddings
        return features

    def tokenize(self, texts):
        return self.tokenizer(texts, padding=True, truncation="longest_first", return_tensors="pt")


class Pooling(nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode_cls_token=False, pooling_mode_max_tokens=False,
                 pooling_mode_mean_tokens=True, pooling_mode_mean_sqrt_len_tokens=False,
                 pooling_mode_weightedmean_tokens=False, pooling_mode_lasttoken=False, include_prompt=True):
        super().__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = pooling_mode_cls_token
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens
        self.pooling_mode_max_tokens = pooling_mode_max_tokens
        self.pooling_mode_mean_sqrt_len_tokens = pooling_mode_mean_sqrt_len_tokens
        self.pooling_mode_weightedmean_tokens = pooling_mode_weightedmean_tokens
        self.pooling_mode_lasttoken = pooling_mode_lasttoken
        self.include_prompt = include_prompt

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        token_embeddings = features["token_embeddings"]
        attention_mask = (
            features["attention_mask"]
            if "attention_mask" in features
            else torch.ones(token_embeddings.shape[:-1], device=token_embeddings.device, dtype=torch.int64)
        )
        if not self.include_prompt and "prompt_length" in features:
            prompt_length = features["prompt_length"]
            if isinstance(prompt_length, torch.Tensor):
                prompt_length = prompt_length[0].item()

            attention_mask[:, :prompt_length] = 0

        ## Pooling strategy
        output_vectors = []
        if self.pooling_mode_cls_token:
            cls_token = features.get("cls_token_embeddings", token_embeddings[:, 0])  # Take first token by default
            output_vectors.append(cls_token)
        if self.pooling_mode_max_tokens:
            input_mask_expanded = (
                attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            )
            token_embeddings[input_mask_expanded == 0] = -1e9  # Set padding tokens to large negative value
            max_over_time = torch.max(token_embeddings, 1)[0]
            output_vectors.append(max_over_time)
        if self.pooling_mode_mean_tokens or self.pooling_mode_mean_sqrt_len_tokens:
            input_mask_expanded = (
                attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            )
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            if "token_weights_sum" in features:
                sum_mask = features["token_weights_sum"].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)

            if self.pooling_mode_mean_tokens:
                output_vectors.append(sum_embeddings / sum_mask)
            if self.pooling_mode_mean_sqrt_len_tokens:
                output_vectors.append(sum_embeddings / torch.sqrt(sum_mask))
        if self.pooling_mode_weightedmean_tokens:
            input_mask_expanded = (
                attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            )
            # token_embeddings shape: bs, seq, hidden_dim
            weights = (
                torch.arange(start=1, end=token_embeddings.shape[1] + 1)
                .unsqueeze(0)
                .unsqueeze(-1)
                .expand(token_embeddings.size())
                .to(token_embeddings.dtype)
                .to(token_embeddings.device)
            )
            assert weights.shape == token_embeddings.shape == input_mask_expanded.shape
            input_mask_expanded = input_mask_expanded * weights

            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            if "token_weights_sum" in features:
                sum_mask = features["token_weights_sum"].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)
            output_vectors.append(sum_embeddings / sum_mask)
        if self.pooling_mode_lasttoken:
            bs, seq_len, hidden_dim = token_embeddings.shape
            values, indices = attention_mask.flip(1).max(1)
            indices = torch.where(values == 0, seq_len - 1, indices)
            gather_indices = seq_len - indices - 1

            # Turn indices from shape [bs] --> [bs, 1, hidden_dim]
            gather_indices = gather_indices.unsqueeze(-1).repeat(1, hidden_dim)
            gather_indices = gather_indices.unsqueeze(1)
            assert gather_indices.shape == (bs, 1, hidden_dim)

            input_mask_expanded = (
                attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            )
            embedding = torch.gather(token_embeddings * input_mask_expanded, 1, gather_indices).squeeze(dim=1)
            output_vectors.append(embedding)

        output_vector = torch.cat(output_vectors, 1)
        features["sentence_embedding"] = output_vector
        return features


class Normalize(nn.Module):
    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        features.update({"sentence_embedding": F.normalize(features["sentence_embedding"], p=2, dim=1)})
        return features


class SentenceTransformer(nn.Sequential):
    def __init__(self, modules):
        super().__init__(*modules)
        self._prompt_length_mapping = {}

    @property
    def tokenizer(self):
        return self[0].tokenizer

    def tokenize(self, texts):
        return self[0].tokenize(texts)

    def _get_prompt_length(self, prompt: str) -> int:
        if (prompt,) in self._prompt_length_mapping:
            return self._prompt_length_mapping[(prompt,)]
        tokenized_prompt = self.tokenize([prompt])
        prompt_length = tokenized_prompt["input_ids"].shape[-1]
        # If the tokenizer adds a special EOS token, we do not count it as part of the prompt length.
        last_token = tokenized_prompt["input_ids"][..., -1].item()
        if hasattr(self.tokenizer, "all_special_ids") and last_token in self.tokenizer.all_special_ids:
            prompt_length -= 1
        self._prompt_length_mapping[(prompt,)] = prompt_length
        return prompt_length

    @torch.no_grad()
    def encode(self, sentences, prompt=None, batch_size=3):
        extra_features = {}
        if prompt is not None and len(prompt) > 0:
            sentences = [prompt + sentence for sentence in sentences]
            length = self._get_prompt_length(prompt)
            if length is not None:
                extra_features["prompt_length"] = length
        # sort by length, as encode does, and restore the order afterwards
        length_sorted_idx = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
        sentences_sorted = [sentences[idx] for idx in length_sorted_idx]
        all_embeddings = []
        for start_index in range(0, len(sentences), batch_size):
            sentences_batch = sentences_sorted[start_index: start_index + batch_size]
            features = self.tokenize(sentences_batch)
            features.update(extra_features)
            out_features = self.forward(features)
            all_embeddings.extend(out_features["sentence_embedding"])
        all_embeddings = [all_embeddings[idx] for idx in sorted(range(len(length_sorted_idx)),
                                                                key=lambda i: length_sorted_idx[i])]
        return torch.stack(all_embeddings)


def reference(model, sentences, prompt_length, modes):
    """Each sentence alone, unpadded, no attention mask; pooling by loops over the kept positions."""
    bert, tok = model[0].auto_model, model[0].tokenizer
    out = []
    for s in sentences:
        ids = torch.tensor([tok._ids(s)])
        h = bert(input_ids=ids)[0][0]
        n = h.size(0)
        kept = list(range(prompt_length, n))
        vecs = []
        for mode in modes:
            if mode == "cls":
                vecs.append(h[0])
            elif mode == "max":
                v = h[kept[0]].clone()
                for t in kept[1:]:
                    v = torch.maximum(v, h[t])
                vecs.append(v)
            elif mode in ("mean", "mean_sqrt_len"):
                acc = torch.zeros(h.size(1))
                for t in kept:
                    acc = acc + h[t]
                vecs.append(acc / len(kept) if mode == "mean" else acc / math.sqrt(len(kept)))
            elif mode == "weightedmean":
                acc, wsum = torch.zeros(h.size(1)), 0.0
                for t in kept:
                    acc = acc + (t + 1) * h[t]
                    wsum += t + 1
                vecs.append(acc / wsum)
            elif mode == "lasttoken":
                vecs.append(h[kept[-1]])
        out.append(F.normalize(torch.cat(vecs), p=2, dim=0))
    return torch.stack(out)


def main():
    cfg = BertConfig(vocab_size=2100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    bert = BertModel(cfg, add_pooling_layer=False).eval()
    tok = Tokenizer()

    queries = ["how do tides work?", "best sourdough starter?", "bake bread at home", "the moon"]
    passages = ["the moon pulls on oceans, causing high and low water twice a day.",
                "flour, yeast, salt.", "knead dough, rise, bake in oven.", "tides"]

    # instruction-style query encoder: the prompt is encoded but left out of the pooling
    query_model = SentenceTransformer([
        Transformer(bert, tok),
        Pooling(32, pooling_mode_max_tokens=True, pooling_mode_mean_tokens=True,
                pooling_mode_mean_sqrt_len_tokens=True, pooling_mode_weightedmean_tokens=True,
                pooling_mode_lasttoken=True, include_prompt=False),
        Normalize(),
    ])
    # passage encoder: CLS + mean, no prompt
    passage_model = SentenceTransformer([
        Transformer(bert, tok),
        Pooling(32, pooling_mode_cls_token=True, pooling_mode_mean_tokens=True),
        Normalize(),
    ])

    prompt = "query: "
    assert query_model._get_prompt_length(prompt) == 3  # [CLS] query :
    q_emb = query_model.encode(queries, prompt=prompt, batch_size=3)
    p_emb = passage_model.encode(passages, batch_size=3)

    with torch.no_grad():
        q_ref = reference(query_model, [prompt + q for q in queries], 3,
                          ["max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken"])
        p_ref = reference(passage_model, passages, 0, ["cls", "mean"])
    torch.testing.assert_close(q_emb, q_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p_emb, p_ref, rtol=1e-4, atol=1e-5)

    sim = q_emb[:, 32:64] @ p_emb[:, 32:].T  # the mean parts of both
    print("query/passage similarity of the mean parts\n", sim)
    print("OK")


if __name__ == "__main__":
    main()
