# poprox-recommender (CCRI-POPROX/poprox-recommender#177, commit 6b83e63): NRMS UserEncoder ran nn.MultiheadAttention
# and AdditiveAttention over the left-padded click history ("PADDED_NEWS" zero vectors) with no padding mask, so the
# user vector, and every candidate score, depends on how many padding slots the history has.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
HIDDEN, HEADS, MAX_CLICKS, N_CAND = 64, 4, 12, 6


def init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight.data)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class AdditiveAttention(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.Tanh(),
            nn.Linear(hidden_dim, 1, bias=False),
        )
        self.softmax = nn.Softmax(dim=-2)
        self.attention.apply(init_weights)

    def forward(self, input, padding_mask=None):
        softmax_input = self.attention(input)
        if padding_mask is not None:
            mask_values = torch.nan_to_num(-torch.inf * padding_mask)
            softmax_input = softmax_input + mask_values.unsqueeze(dim=2)
        attention_weights = self.softmax(softmax_input)
        attention_outputs = input * attention_weights
        weighted_sum = torch.sum(attention_outputs, dim=1)
        return weighted_sum, attention_outputs, attention_weights


class UserEncoder(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super(UserEncoder, self).__init__()
        self.multihead_attention = nn.MultiheadAttention(
            embed_dim=hidden_size, num_heads=num_attention_heads, batch_first=True
        )
        self.additive_attention = AdditiveAttention(hidden_size, 200)

    def forward(self, news_vectors):
        if FIXED:
            nonzero = news_vectors.sum(dim=2).bool()
            padding_mask = ~nonzero
            multihead_attn_output, _ = self.multihead_attention(
                news_vectors, news_vectors, news_vectors, key_padding_mask=padding_mask
            )
            user_vectors, _, _ = self.additive_attention(multihead_attn_output, padding_mask=padding_mask)
            return user_vectors
        # before the fix: no key_padding_mask, additive-attention softmax over every slot, padding included
        multihead_attn_output, _ = self.multihead_attention(news_vectors, news_vectors, news_vectors)
        user_vectors, _, _ = self.additive_attention(multihead_attn_output)
        return user_vectors


class DotProductClickPredictor(torch.nn.Module):
    def forward(self, candidate_news_vector, user_vector):
        # batch_size, candidate_size
        return torch.bmm(candidate_news_vector, user_vector.unsqueeze(dim=-1)).squeeze(dim=-1)


user_encoder = UserEncoder(HIDDEN, HEADS).eval()
click_predictor = DotProductClickPredictor()

# NRMSUserEmbedder: article_ids = ["PADDED_NEWS"] * padded_positions + article_ids, PADDED_NEWS = zeros
lens = [12, 7, 3]
histories = [torch.randn(L, HIDDEN) for L in lens]
clicked_news_vector = torch.stack(
    [torch.cat([torch.zeros(MAX_CLICKS - h.shape[0], HIDDEN), h]) for h in histories]
)
candidate_news_vector = torch.randn(len(lens), N_CAND, HIDDEN)

with torch.no_grad():
    user_vector = user_encoder(clicked_news_vector)
    scores = click_predictor(candidate_news_vector, user_vector)
    # reference: each user's click history alone, without padding slots
    ref = torch.stack([user_encoder(h.unsqueeze(0))[0] for h in histories])
    ref_scores = click_predictor(candidate_news_vector, ref)
    print("max |user_vector(padded) - user_vector(alone)|:", float((user_vector - ref).abs().max()))
    print("max |click score(padded) - click score(alone)|:", float((scores - ref_scores).abs().max()))
