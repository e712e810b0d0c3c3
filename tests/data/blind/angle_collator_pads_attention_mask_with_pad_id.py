"""AnglE: AngleDataCollator pads the attention_mask as if it were input_ids, with the tokenizer's pad id.

Citation: SeanLee97/AnglE#89 (branch bugfix/attention-mask, merge b08db1f; fix commit ef0b987 "fix angle-emb").
For inputs that do not end with an EOS, ``AngleDataCollator.__call__`` padded the ids, then padded each
feature's ``attention_mask`` again through ``self.tokenizer.pad({'input_ids': [...attention masks...]})`` and
stored its ``input_ids``: the padded slots of the mask got ``pad_token_id``. With a RoBERTa-style tokenizer
(``<pad>`` = 1) every padded position is marked 1 and the encoder attends to the padding of the shorter texts.
The fix asks the first ``tokenizer.pad`` call for ``return_attention_mask=True`` and drops the second padding.

The collator below is the pre-fix code (token_type_ids branch kept); the tokenizer is a
PreTrainedTokenizerFast over an in-memory WordLevel vocabulary with RoBERTa's special ids, and the model is a
randomly initialised transformers RobertaModel (SDPA attention) pooled on the CLS token as AnglE does.
"""
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, RobertaConfig, RobertaModel
from transformers.utils import PaddingStrategy

FIXED = "--fixed" in sys.argv


@dataclass
class AngleDataCollator:
    tokenizer: PreTrainedTokenizerBase
    padding: Union[bool, str, PaddingStrategy] = 'longest'
    max_length: Optional[int] = None
    return_tensors: str = "pt"
    filter_duplicate: bool = True

    def __call__(self, features: List[Dict], return_tensors: str = "pt") -> Dict[str, torch.Tensor]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        has_token_type_ids = "token_type_ids" in features[0]
        end_with_eos = features[0]['extra']['end_with_eos']

        new_features = []
        duplicate_set = set()
        for feature in features:
            seperate_ids = feature['seperate_ids']
            input_ids = feature['input_ids']
            attention_mask = feature['attention_mask']
            assert len(seperate_ids) == len(input_ids) == len(attention_mask)

            has_token_type_ids = False
            if "token_type_ids" in feature:
                has_token_type_ids = True
                token_type_ids = feature['token_type_ids']
                assert len(token_type_ids) == len(input_ids)

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
                if has_token_type_ids:
                    new_feature['token_type_ids'] = token_type_ids[prev_start_idx:start_idx]
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
            if has_token_type_ids:
                new_feature['token_type_ids'] = token_type_ids[prev_start_idx:]
            new_feature['labels'] = feature['labels']
            current_features.append(new_feature)

            if self.filter_duplicate and is_duplicate:
                continue
            new_features += current_features

        # remove features
        del features

        if end_with_eos:
            features = {}
            features['input_ids'] = [feature['input_ids'] + [self.tokenizer.eos_token_id] for feature in new_features]
            features = self.tokenizer.pad(
                features,
                padding=self.padding,
                return_attention_mask=True,
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
            if has_token_type_ids:
                features['token_type_ids'] = self.tokenizer.pad(
                    {'input_ids': [feature['token_type_ids'] for feature in new_features]},
                    padding=self.padding,
                    max_length=self.max_length,
                    return_tensors=return_tensors,
                )['input_ids']
        features['labels'] = torch.Tensor([feature['labels'] for feature in new_features])

        return features


def build_tokenizer():
    words = "a cat sat on the mat dog ran in park quickly yesterday afternoon".split()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(words)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def angle_tokenize(tokenizer, text1, text2, label):
    """What AngleDataTokenizer yields for one pair: both texts concatenated, seperate_ids marking the second."""
    ids1 = [tokenizer.bos_token_id] + tokenizer(text1, add_special_tokens=False)['input_ids']
    ids2 = [tokenizer.bos_token_id] + tokenizer(text2, add_special_tokens=False)['input_ids']
    return {'input_ids': ids1 + ids2, 'attention_mask': [1] * (len(ids1) + len(ids2)),
            'seperate_ids': [0] * len(ids1) + [1] * len(ids2), 'labels': label,
            'extra': {'end_with_eos': False}}


def main():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    features = [angle_tokenize(tokenizer, "a cat sat on the mat", "a dog ran", 1.0),
                angle_tokenize(tokenizer, "the dog ran in the park quickly yesterday afternoon", "the cat sat", 0.0)]
    batch = AngleDataCollator(tokenizer)(features)
    config = RobertaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = "sdpa"
    model = RobertaModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        out = model(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).last_hidden_state
    cls = out[:, 0]
    print("mask row 1:", batch['attention_mask'][1].tolist(), "cls row 1:", [round(v, 4) for v in cls[1, :3].tolist()])


if __name__ == "__main__":
    main()
