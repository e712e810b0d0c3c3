# huggingface/transformers PR #8409 (fixes #6812): DataCollatorForPermutationLanguageModeling.mask_tokens
# built the non-functional-token mask as ~(padding_mask & special_tokens_mask) instead of ~(padding | special), so
# <sep>/<cls> get factorisation rank -1 and their perm_mask rows block every masked token (XLNet's data_utils does not).
import sys

import torch
from transformers import XLNetConfig, XLNetLMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyXLNetTokenizer:
    # stands in for XLNetTokenizer: <cls>=3, <sep>=4, <pad>=5, <mask>=6; padding on the left, "<sep> <cls>" at the end
    cls_token_id, sep_token_id, pad_token_id, mask_token_id = 3, 4, 5, 6
    mask_token = "<mask>"
    _pad_token = "<pad>"
    all_special_ids = [0, 1, 2, 3, 4, 5, 6]

    def get_special_tokens_mask(self, token_ids, already_has_special_tokens=False):
        return [1 if t in self.all_special_ids else 0 for t in token_ids]


class DataCollatorForPermutationLanguageModeling:
    def __init__(self, tokenizer, plm_probability=1 / 6, max_span_length=5):
        self.tokenizer = tokenizer
        self.plm_probability = plm_probability
        self.max_span_length = max_span_length

    def __call__(self, inputs):
        inputs, perm_mask, target_mapping, labels = self.mask_tokens(inputs)
        return {"input_ids": inputs, "perm_mask": perm_mask, "target_mapping": target_mapping, "labels": labels}

    def mask_tokens(self, inputs):
        if inputs.size(1) % 2 != 0:
            raise ValueError("This collator requires that sequence lengths be even")
        labels = inputs.clone()
        masked_indices = torch.full(labels.shape, 0, dtype=torch.bool)
        target_mapping = torch.zeros((labels.size(0), labels.size(1), labels.size(1)), dtype=torch.float32)

        for i in range(labels.size(0)):
            cur_len = 0
            max_len = labels.size(1)
            while cur_len < max_len:
                span_length = torch.randint(1, self.max_span_length + 1, (1,)).item()
                context_length = int(span_length / self.plm_probability)
                start_index = cur_len + torch.randint(context_length - span_length + 1, (1,)).item()
                masked_indices[i, start_index : start_index + span_length] = 1
                cur_len += context_length
            target_mapping[i] = torch.eye(labels.size(1))

        special_tokens_mask = torch.tensor(
            [self.tokenizer.get_special_tokens_mask(val, already_has_special_tokens=True) for val in labels.tolist()],
            dtype=torch.bool,
        )
        masked_indices.masked_fill_(special_tokens_mask, value=0.0)
        if self.tokenizer._pad_token is not None:
            padding_mask = labels.eq(self.tokenizer.pad_token_id)
            masked_indices.masked_fill_(padding_mask, value=0.0)

        # Mask indicating non-functional tokens, where functional tokens are [SEP], [CLS], padding, etc.
        if FIXED:
            non_func_mask = ~(padding_mask | special_tokens_mask)
        else:
            non_func_mask = ~(padding_mask & special_tokens_mask)

        inputs[masked_indices] = self.tokenizer.mask_token_id
        labels[~masked_indices] = -100  # We only compute loss on masked tokens

        perm_mask = torch.zeros((labels.size(0), labels.size(1), labels.size(1)), dtype=torch.float32)
        for i in range(labels.size(0)):
            perm_index = torch.arange(labels.size(1))
            perm_index = perm_index.reshape((-1, labels.size(1) // 2)).transpose(0, 1)
            perm_index = perm_index[torch.randperm(labels.size(1) // 2)]
            perm_index = torch.flatten(perm_index.transpose(0, 1))
            # non-masked, non-functional tokens get the smallest index (-1): seen by all, see no masked token
            perm_index.masked_fill_(~masked_indices[i] & non_func_mask[i], -1)
            perm_mask[i] = (
                perm_index.reshape((labels.size(1), 1)) <= perm_index.reshape((1, labels.size(1)))
            ) & masked_indices[i]
        return inputs.long(), perm_mask, target_mapping, labels.long()


tok = TinyXLNetTokenizer()
L = 24
rows = []
for n_real in (22, 16, 20):
    body = torch.randint(7, 64, (n_real,)).tolist()
    rows.append([tok.pad_token_id] * (L - n_real - 2) + body + [tok.sep_token_id, tok.cls_token_id])
batch = DataCollatorForPermutationLanguageModeling(tok, plm_probability=0.5)(torch.tensor(rows))

config = XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.0, initializer_range=0.2)
model = XLNetLMHeadModel(config)
out = model(**batch)  # run_plm.py: the Trainer feeds the collator's dict as-is
out.loss.backward()

func = (batch["input_ids"] == tok.sep_token_id) | (batch["input_ids"] == tok.cls_token_id)
seen_by_func = ((1 - batch["perm_mask"]) * (batch["labels"] != -100)[:, None, :].float())[func].sum().item()
print(f"masked-target keys visible to <sep>/<cls> queries: {int(seen_by_func)}  plm loss: {out.loss.item():.6f}")
