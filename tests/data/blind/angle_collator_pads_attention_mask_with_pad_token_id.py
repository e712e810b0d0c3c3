"""AnglE's data collator padded `attention_mask` with the tokenizer's pad *token id*.

Citation: SeanLee97/AnglE PR #89 ("fix padding attention mask", merged as b08db1f; fix commit
ef0b987 "fix angle-emb").  Source read: angle_emb/angle.py `AngleDataCollator.__call__` before
and after the merge.

Bug: for models that do not end with EOS, the collator padded the split text pairs with
`tokenizer.pad({'input_ids': ...})` and then padded the attention masks by passing them *as
input_ids* through `tokenizer.pad(...)['input_ids']`.  Their padding value is therefore
`pad_token_id` — 1 for RoBERTa-style vocabularies — so every pad position of a shorter text
gets attention_mask 1 and the encoder attends to the padding (token_type_ids likewise).
Fix (ef0b987): one `tokenizer.pad(..., return_attention_mask=True)` call that builds the mask.

Reproduction: AngleDataCollator on two tokenized pairs (texts of 5/3 and 4/6 tokens) with a
RoBERTa-like tokenizer stand-in (pad_token_id=1; its `pad` follows HF's right padding and
default `return_attention_mask`), then a small RoBERTa-style encoder whose self-attention takes
the extended additive mask `(1 - attention_mask) * finfo.min` through SDPA, CLS pooling.
"""
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class RobertaLikeTokenizer:
    """Stand-in for a RoBERTa PreTrainedTokenizer: only `pad`, HF semantics (right side)."""
    pad_token_id = 1
    eos_token_id = 2
    model_input_names = ["input_ids", "attention_mask"]

    def pad(self, encoded_inputs, padding="longest", max_length=None, return_attention_mask=None,
            return_tensors=None):
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        ids = encoded_inputs["input_ids"]
        target = max_length if (padding == "max_length" and max_length) else max(len(x) for x in ids)
        out = {"input_ids": [list(x) + [self.pad_token_id] * (target - len(x)) for x in ids]}
        if return_attention_mask:
            out["attention_mask"] = [[1] * len(x) + [0] * (target - len(x)) for x in ids]
        if return_tensors == "pt":
            out = {k: torch.tensor(v) for k, v in out.items()}
        return out


@dataclass
class AngleDataCollator:
    tokenizer: RobertaLikeTokenizer
    padding: str = 'longest'
    max_length: Optional[int] = None
    return_tensors: str = "pt"
    filter_duplicate: bool = True

    def __call__(self, features: List[Dict], return_tensors: str = "pt") -> Dict[str, torch.Tensor]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        end_with_eos = features[0]['extra']['end_with_eos']

        new_features = []
        duplicate_set = set()
        for feature in features:
            seperate_ids = feature['seperate_ids']
            input_ids = feature['input_ids']
            attention_mask = feature['attention_mask']
            assert len(seperate_ids) == len(input_ids) == len(attention_mask)

            max_seperate_id = max(seperate_ids)
            prev_start_idx = 0
            current_features = []
            is_duplicate = False
            for seperate_id in range(1, max_seperate_id + 1):
                start_idx = seperate_ids.index(seperate_id)
                new_feature = {}
                new_input_ids = input_ids[prev_start_idx:start_idx]
                if tuple(new_input_ids) in duplicate_set:
                    is_duplicate = True
                    if self.filter_duplicate:
                        break
                duplicate_set.add(tuple(new_input_ids))
                new_feature['input_ids'] = new_input_ids
                new_feature['attention_mask'] = attention_mask[prev_start_idx:start_idx]
                new_feature['labels'] = feature['labels']
                current_features.append(new_feature)
                prev_start_idx = start_idx

            # last
            new_feature = {}
            new_input_ids = input_ids[prev_start_idx:]
            if tuple(new_input_ids) in duplicate_set:
                is_duplicate = True
            duplicate_set.add(tuple(new_input_ids))
            new_feature['input_ids'] = new_input_ids
            new_feature['attention_mask'] = attention_mask[prev_start_idx:]
            new_feature['labels'] = feature['labels']
            current_features.append(new_feature)

            if self.filter_duplicate and is_duplicate:
                continue
            new_features += current_features

        del features

        if end_with_eos:
            features = {}
            features['input_ids'] = [feature['input_ids'] + [self.tokenizer.eos_token_id] for feature in new_features]
            features = self.tokenizer.pad(features, padding=self.padding, return_attention_mask=True,
                                          return_tensors=return_tensors)
        elif FIXED:
            features = self.tokenizer.pad(
                {'input_ids': [feature['input_ids'] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_attention_mask=True,
                return_tensors=return_tensors,
            )
        else:
            features = self.tokenizer.pad(
                {'input_ids': [feature['input_ids'] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_tensors=return_tensors,
            )
            features['attention_mask'] = self.tokenizer.pad(
                {'input_ids': [feature['attention_mask'] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_tensors=return_tensors,
            )['input_ids']
        features['labels'] = torch.Tensor([feature['labels'] for feature in new_features])
        return features


class RobertaLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.norm1 = nn.LayerNorm(hidden_size)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))
        self.norm2 = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, extended_attention_mask):
        def heads(t):
            return t.unflatten(-1, (self.num_attention_heads, -1)).transpose(1, 2)

        q, k, v = heads(self.query(hidden_states)), heads(self.key(hidden_states)), heads(self.value(hidden_states))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=extended_attention_mask)
        hidden_states = self.norm1(hidden_states + self.dense(ctx.transpose(1, 2).flatten(-2)))
        return self.norm2(hidden_states + self.ffn(hidden_states))


class RobertaModel(nn.Module):
    def __init__(self, vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, padding_idx=1):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=padding_idx)
        self.position_embeddings = nn.Embedding(64, hidden_size)
        self.layer = nn.ModuleList([RobertaLayer(hidden_size, num_attention_heads) for _ in range(num_hidden_layers)])

    def forward(self, input_ids, attention_mask):
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(input_ids.shape[1]))
        extended_attention_mask = attention_mask[:, None, None, :].to(hidden_states.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(hidden_states.dtype).min
        for layer in self.layer:
            hidden_states = layer(hidden_states, extended_attention_mask)
        return hidden_states


def tokenized_pair(ids1, ids2, label):
    input_ids = ids1 + ids2
    return {'input_ids': input_ids, 'attention_mask': [1] * len(input_ids),
            'seperate_ids': [0] * len(ids1) + [1] * len(ids2), 'labels': label, 'extra': {'end_with_eos': False}}


if __name__ == "__main__":
    torch.manual_seed(0)
    collator = AngleDataCollator(RobertaLikeTokenizer())
    batch = collator([tokenized_pair([0, 11, 12, 13, 2], [0, 21, 2], 1),
                      tokenized_pair([0, 31, 32, 2], [0, 41, 42, 43, 44, 2], 0)])
    model = RobertaModel().eval()
    with torch.no_grad():
        cls = model(batch['input_ids'], batch['attention_mask'])[:, 0]
    print(f"attention_mask row 1: {batch['attention_mask'][1].tolist()}, cls[1,0] {cls[1, 0].item():.4f}")
