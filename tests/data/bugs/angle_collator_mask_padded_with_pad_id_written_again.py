# SeanLee97/AnglE#89: AngleDataCollator padded each attention_mask with tokenizer.pad(...) as if it were input_ids,
# so padded slots got pad_token_id (1 for RoBERTa) instead of 0 and the encoder attended to padding.
import sys

import torch
from transformers import RobertaConfig, RobertaModel

FIXED = "--fixed" in sys.argv


class RobertaLikeTokenizer:
    """The two things the collator uses from a RoBERTa tokenizer: pad_token_id=1 and right padding."""

    pad_token_id = 1
    eos_token_id = 2
    padding_side = "right"

    def pad(self, encoded_inputs, padding="longest", max_length=None, return_attention_mask=True,
            return_tensors="pt"):
        ids = encoded_inputs["input_ids"]
        length = max(len(x) for x in ids) if padding == "longest" else max_length
        out = {"input_ids": [], "attention_mask": []}
        for x in ids:
            diff = length - len(x)
            out["input_ids"].append(list(x) + [self.pad_token_id] * diff)
            out["attention_mask"].append([1] * len(x) + [0] * diff)
        if not return_attention_mask:
            out.pop("attention_mask")
        return {k: torch.tensor(v) for k, v in out.items()}


class AngleDataCollator:
    def __init__(self, tokenizer, padding="longest", max_length=None):
        self.tokenizer = tokenizer
        self.padding = padding
        self.max_length = max_length

    def __call__(self, new_features, return_tensors="pt"):
        if FIXED:
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


class Pooler:
    def __init__(self, model, pooling_strategy="cls"):
        self.model = model
        self.pooling_strategy = pooling_strategy

    def __call__(self, inputs):
        outputs = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        return outputs.last_hidden_state[:, 0]


def main():
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                           attn_implementation="sdpa")
    model = RobertaModel(config, add_pooling_layer=False).eval()
    tokenizer = RobertaLikeTokenizer()
    collator = AngleDataCollator(tokenizer)
    # a text pair (label 1): the second text is shorter and gets right-padded in the batch
    pair = [
        {"input_ids": [0, 11, 23, 35, 47, 12, 9, 2], "attention_mask": [1] * 8, "labels": 1},
        {"input_ids": [0, 40, 17, 2], "attention_mask": [1] * 4, "labels": 1},
    ]
    batch = collator(pair)
    print("collated attention_mask of the short text:", batch["attention_mask"][1].tolist())
    pooler = Pooler(model)
    with torch.no_grad():
        emb = pooler(batch)
        alone = pooler(collator(pair[1:]))
    print("max |emb(short, batched) - emb(short, alone)| =", (emb[1] - alone[0]).abs().max().item())


if __name__ == "__main__":
    main()
