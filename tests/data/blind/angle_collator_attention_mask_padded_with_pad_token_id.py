"""AnglE AngleDataCollator: the attention masks are padded like input_ids, with pad_token_id.

Citation: SeanLee97/AnglE#89 ("fix padding attention mask", branch bugfix/attention-mask, merge
b08db1f; fix commit ef0b987 "fix angle-emb"). Read in the upstream git history
(angle_emb/angle.py before and after the merge).

Bug: in ``AngleDataCollator.__call__`` (the non-``end_with_eos`` path) the per-text
``attention_mask`` lists were padded with a second call
``self.tokenizer.pad({'input_ids': [feature['attention_mask'] ...]}, ...)['input_ids']`` -- i.e.
padded as if they were token ids, with ``tokenizer.pad_token_id``. For a tokenizer whose pad id
is 1 (RoBERTa / XLM-R backbones, AnglE's usual ones) every padded position gets mask value 1, so
the encoder attends the ``<pad>`` tokens of every shorter text in the batch.
Fix: the second pad call is removed; the first call uses ``return_attention_mask=True``, so the
tokenizer builds the 0/1 mask itself.

Reproduction: AngleDataTokenizer-style features for a pair of texts (``seperate_ids`` split) go
through the collator; a minimal stand-in for the HF tokenizer's ``pad`` (right padding with
``pad_token_id=1``, as ``PreTrainedTokenizerBase.pad`` does; no vocabulary files available
offline) pads them; a transformers ``RobertaModel`` built from ``RobertaConfig`` (random weights,
SDPA attention) encodes the batch and AnglE's ``cls`` pooling takes the first token.
"""
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from transformers import RobertaConfig, RobertaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PaddingTokenizer:
    """Stand-in for PreTrainedTokenizerBase.pad (right padding) of a RoBERTa tokenizer."""

    pad_token_id = 1
    eos_token_id = 2
    padding_side = "right"

    def pad(self, encoded_inputs, padding="longest", max_length=None, return_attention_mask=None,
            return_tensors=None):
        ids = encoded_inputs["input_ids"]
        length = max(len(x) for x in ids) if padding == "longest" else max_length
        out = {"input_ids": [list(x) + [self.pad_token_id] * (length - len(x)) for x in ids]}
        if return_attention_mask:
            out["attention_mask"] = [[1] * len(x) + [0] * (length - len(x)) for x in ids]
        if return_tensors == "pt":
            out = {k: torch.tensor(v) for k, v in out.items()}
        return out


@dataclass
class AngleDataCollator:
    tokenizer: PaddingTokenizer
    padding: str = "longest"
    max_length: Optional[int] = None
    return_tensors: str = "pt"
    filter_duplicate: bool = True

    def __call__(self, features: List[Dict], return_tensors: str = "pt") -> Dict[str, torch.Tensor]:
        end_with_eos = features[0]["extra"]["end_with_eos"]
        new_features = []
        for feature in features:
            seperate_ids = feature["seperate_ids"]
            input_ids = feature["input_ids"]
            attention_mask = feature["attention_mask"]
            prev_start_idx = 0
            for seperate_id in range(1, max(seperate_ids) + 1):
                start_idx = seperate_ids.index(seperate_id)
                new_features.append({
                    "input_ids": input_ids[prev_start_idx:start_idx],
                    "attention_mask": attention_mask[prev_start_idx:start_idx],
                    "labels": feature["labels"],
                })
                prev_start_idx = start_idx
            # last
            new_features.append({
                "input_ids": input_ids[prev_start_idx:],
                "attention_mask": attention_mask[prev_start_idx:],
                "labels": feature["labels"],
            })

        if end_with_eos:
            raise NotImplementedError("only the non-eos path is reproduced")
        if FIXED:
            features = self.tokenizer.pad(
                {"input_ids": [feature["input_ids"] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_attention_mask=True,
                return_tensors=return_tensors,
            )
        else:
            features = self.tokenizer.pad(
                {"input_ids": [feature["input_ids"] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_tensors=return_tensors,
            )
            features["attention_mask"] = self.tokenizer.pad(
                {"input_ids": [feature["attention_mask"] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_tensors=return_tensors,
            )["input_ids"]
        features["labels"] = torch.Tensor([feature["labels"] for feature in new_features])
        return features


if __name__ == "__main__":
    config = RobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1, attn_implementation="sdpa",
    )
    backbone = RobertaModel(config, add_pooling_layer=False).eval()
    # AngleDataTokenizer output for one pair: text1 (8 tokens) + text2 (4 tokens), seperate_ids 0/1
    text1 = [0, 11, 23, 7, 31, 19, 5, 2]
    text2 = [0, 14, 9, 2]
    feature = {
        "input_ids": text1 + text2,
        "attention_mask": [1] * (len(text1) + len(text2)),
        "seperate_ids": [0] * len(text1) + [1] * len(text2),
        "labels": 1,
        "extra": {"end_with_eos": False},
    }
    collator = AngleDataCollator(tokenizer=PaddingTokenizer())
    batch = collator([feature])
    with torch.no_grad():
        out = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        alone = backbone(input_ids=torch.tensor([text2]), attention_mask=torch.ones(1, len(text2), dtype=torch.long)).last_hidden_state
    cls_batched, cls_alone = out[1, 0], alone[0, 0]  # pooling_strategy="cls"
    print("fixed" if FIXED else "buggy", "attention_mask[1]:", batch["attention_mask"][1].tolist(),
          "cls diff:", f"{(cls_batched - cls_alone).abs().max().item():.4f}")
