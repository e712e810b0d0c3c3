# SeanLee97/AnglE#89 (merge b08db1f, fix commit ef0b987): AngleDataCollator padded the attention_mask
# lists with tokenizer.pad(...) as if they were input_ids, so padded slots got pad_token_id (1 for RoBERTa) and padding was attended.
import sys
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast, RobertaConfig, RobertaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# RoBERTa-style vocabulary: <s>=0, <pad>=1, </s>=2 (pad_token_id != 0)
vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
for i, w in enumerate("the cat sat on a mat dog ran far away quickly home".split()):
    vocab[w] = 4 + i
tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                    pad_token="<pad>", unk_token="<unk>")


class AngleDataCollator:
    def __init__(self, tokenizer, padding="longest", max_length=None):
        self.tokenizer = tokenizer
        self.padding = padding
        self.max_length = max_length

    def __call__(self, features, return_tensors="pt"):
        has_token_type_ids = "token_type_ids" in features[0]
        new_features = features  # (the seperator-splitting of the original is a no-op for single texts)
        if not FIXED:
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
        else:
            features = self.tokenizer.pad(
                {'input_ids': [feature['input_ids'] for feature in new_features]},
                padding=self.padding,
                max_length=self.max_length,
                return_attention_mask=True,
                return_tensors=return_tensors,
            )
        features['labels'] = torch.Tensor([feature['labels'] for feature in new_features])
        return features


def encode(text, label):
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label}


config = RobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                       attn_implementation="eager")
model = RobertaModel(config).eval()

texts = ["the cat sat on a mat and the dog ran far away quickly home", "a cat ran home"]
feats = [encode(t, 1) for t in texts]
collator = AngleDataCollator(tokenizer)
batch = collator(feats)
print("attention_mask of short row:", batch["attention_mask"][1].tolist())

with torch.no_grad():
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    emb_batched = out[:, 0]  # Pooler 'cls'
    alone = collator([feats[1]])
    emb_alone = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"]).last_hidden_state[:, 0]
diff = (emb_batched[1] - emb_alone[0]).abs().max().item()
print(f"max |cls(batched padded) - cls(alone)| for the short text: {diff:.6f}")
