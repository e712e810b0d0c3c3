# CCRI-POPROX/poprox-recommender#144 (commit 36008437, "Address warnings, including attention mask issue that
# changes the recs"); code read at 36008437^: src/poprox_recommender/model/nrms/news_encoder.py (NewsEncoder),
# model/general/attention/newsadditive.py, model/nrms/user_encoder.py, components/embedders/article.py
# (NRMSArticleEmbedder: headlines tokenized with padding="max_length", max_length=TITLE_LENGTH_LIMIT).
#
# Bug: NewsEncoder.forward ran DistilBERT as `self.plm(news_input)`, with no attention_mask, so every headline's
# tokens attended to the [PAD] (id 0) slots that fill it out to TITLE_LENGTH_LIMIT; the article embeddings, and so
# the recommendations, changed with the padding.
# Fix: `self.plm(news_input, attention_mask=news_input.bool().int())` (pad id 0 -> mask 0).
#
# Trimmed to CPU size: DistilBERT built from a tiny DistilBertConfig instead of distilbert-base-uncased, headlines
# given as token ids ([CLS] ... [SEP], then pads) instead of the tokenizer's output.
import sys

import torch
from torch import nn
from transformers import DistilBertConfig, DistilBertModel

FIXED = "--fixed" in sys.argv

TITLE_LENGTH_LIMIT = 12
CLS_ID, SEP_ID, PAD_ID = 101, 102, 0


def init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight.data)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class NewsAdditiveAttention(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.Tanh(),
            nn.Linear(hidden_dim, 1, bias=False),
            nn.Softmax(dim=-2),
        )
        self.attention.apply(init_weights)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        attention_weight = self.attention(input)
        return input * attention_weight


class AdditiveAttention(nn.Module):
    def __init__(self, candidate_vector_dim, query_vector_dim):
        super().__init__()
        self.linear = nn.Linear(candidate_vector_dim, query_vector_dim)
        self.attention_query_vector = nn.Parameter(torch.empty(query_vector_dim).uniform_(-0.1, 0.1))

    def forward(self, candidate_vector):
        temp = torch.tanh(self.linear(candidate_vector))
        candidate_weights = torch.softmax(torch.matmul(temp, self.attention_query_vector), dim=1)
        return candidate_vector * candidate_weights.unsqueeze(-1)


class NewsEncoder(torch.nn.Module):
    def __init__(self, plm_config, num_attention_heads, additive_attn_hidden_dim):
        super(NewsEncoder, self).__init__()
        self.plm = DistilBertModel(plm_config)
        self.plm_hidden_size = plm_config.hidden_size
        self.multihead_attention = nn.MultiheadAttention(
            embed_dim=self.plm_hidden_size,
            num_heads=num_attention_heads,
            batch_first=True,
        )
        self.additive_attention = NewsAdditiveAttention(self.plm_hidden_size, additive_attn_hidden_dim)

    @property
    def embedding_size(self) -> int:
        return self.plm_hidden_size

    def forward(self, news_input: torch.Tensor) -> torch.Tensor:
        # batch_size, num_words_title, word_embedding_dim
        if FIXED:
            V = self.plm(news_input, attention_mask=news_input.bool().int()).last_hidden_state
        else:
            V = self.plm(news_input).last_hidden_state
        multihead_attn_output, _ = self.multihead_attention(V, V, V)
        additive_attn_output = self.additive_attention(multihead_attn_output)
        output = torch.sum(additive_attn_output, dim=1)
        return output


class UserEncoder(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super(UserEncoder, self).__init__()
        self.multihead_attention = nn.MultiheadAttention(
            embed_dim=hidden_size, num_heads=num_attention_heads, batch_first=True
        )
        self.additive_attention = AdditiveAttention(hidden_size, 16)

    def forward(self, user_vector):
        multihead_attn_output, _ = self.multihead_attention(user_vector, user_vector, user_vector)
        additive_attn_output = self.additive_attention(multihead_attn_output)
        return torch.sum(additive_attn_output, dim=1)


def encode_headline(word_ids):
    # tokenizer.encode(headline, padding="max_length", max_length=TITLE_LENGTH_LIMIT, truncation=True)
    ids = [CLS_ID] + list(word_ids)[: TITLE_LENGTH_LIMIT - 2] + [SEP_ID]
    return ids + [PAD_ID] * (TITLE_LENGTH_LIMIT - len(ids))


def main():
    torch.manual_seed(0)
    plm_config = DistilBertConfig(
        vocab_size=200, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64, pad_token_id=0
    )
    news_encoder = NewsEncoder(plm_config, num_attention_heads=4, additive_attn_hidden_dim=16).eval()
    user_encoder = UserEncoder(plm_config.hidden_size, num_attention_heads=4).eval()

    g = torch.Generator().manual_seed(1)
    clicked_headlines = [torch.randint(110, 200, (n,), generator=g).tolist() for n in (7, 4, 9)]
    candidate_headlines = [torch.randint(110, 200, (n,), generator=g).tolist() for n in (3, 10, 6, 5)]

    with torch.no_grad():
        # NRMSArticleEmbedder: stack the tokenized headlines, embed them with the news encoder
        clicked_tokens = torch.stack(
            [torch.tensor(encode_headline(h), dtype=torch.int32) for h in clicked_headlines]
        )
        candidate_tokens = torch.stack(
            [torch.tensor(encode_headline(h), dtype=torch.int32) for h in candidate_headlines]
        )
        clicked_vectors = news_encoder(clicked_tokens)
        candidate_vectors = news_encoder(candidate_tokens)

        user_vector = user_encoder(clicked_vectors.unsqueeze(0))[0]
        scores = candidate_vectors @ user_vector
        ranking = torch.argsort(scores, descending=True)

    print("candidate scores:", [round(s, 5) for s in scores.tolist()])
    print("ranking:", ranking.tolist())


if __name__ == "__main__":
    main()
