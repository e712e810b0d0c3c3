"""InternVL fine-tuning: concat_pad_data_collator builds attention_mask with its default pad_id=0.

Citation: OpenGVLab/InternVL#967 ("[Bug] Attention_mask is all True due to the mismatched pad_token_id",
closed) and OpenGVLab/InternVL#908 ("concat_pad_data_collator的pad_id为0可能有问题": a real token whose id
is 0 — '!' in the InternVL2-76B tokenizer — gets attention_mask False). I read both issue texts; the fix
is the one #967 proposes (bind the collator's pad_id to tokenizer.pad_token_id with functools.partial in
internvl_chat_finetune.py); I did not read a fix commit.

Bug: preprocess_internvl2_5 (group_by_length False) already pads input_ids to max_length with the
tokenizer's pad_token_id (2). concat_pad_data_collator then pads again with pad_id=0 and computes
attention_mask = input_ids.ne(pad_id): the real padding (2) is attended, and any real token with id 0 is
masked out as a key for every later query.

Fix: collator = partial(concat_pad_data_collator, pad_id=tokenizer.pad_token_id).

This program: the dataset's preprocess padding, the collator as InternVL wrote it, and an InternLM2-style
language model whose eager attention adds the old HF _make_causal_mask/_expand_mask float mask to q @ k^T.
"""
import sys
from functools import partial

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

IGNORE_INDEX = -100


class Tokenizer:
    pad_token_id = 2  # InternVL2.5-2B's config.json
    model_max_length = 10


def preprocess_internvl2_5(token_ids, tokenizer, group_by_length=False):
    input_ids = torch.tensor(token_ids)
    labels = input_ids.clone()
    if not group_by_length:  # padding='max_length'
        pad = tokenizer.model_max_length - len(token_ids)
        input_ids = torch.cat([input_ids, torch.full((pad,), tokenizer.pad_token_id)])
        labels = torch.cat([labels, torch.full((pad,), IGNORE_INDEX)])
    return {"input_ids": input_ids, "labels": labels}


def concat_pad_data_collator(features, max_item_length=None, pad_id=0):
    first = features[0]
    batch = {}
    batch_lens = [feat["input_ids"].shape for feat in features]
    max_item_length = max_item_length or max(batch_lens)[0]
    for idx in range(len(features)):
        feat = features[idx]
        temp_input_ids = torch.LongTensor([pad_id] * max_item_length)
        temp_input_ids[:feat["input_ids"].shape[0]] = feat["input_ids"]
        feat["input_ids"] = temp_input_ids
        temp_labels = torch.LongTensor([IGNORE_INDEX] * max_item_length)
        temp_labels[:feat["labels"].shape[0]] = feat["labels"]
        feat["labels"] = temp_labels
        feat["attention_mask"] = feat["input_ids"].ne(pad_id)
    for k, v in first.items():
        if v is not None and not isinstance(v, str):
            batch[k] = torch.stack([f[k] for f in features])
    return batch


def _make_causal_mask(input_ids_shape, dtype):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class InternLM2Attention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.wqkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.wo = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.wqkv(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        attn_weights = q @ k.transpose(2, 3) / self.head_dim ** 0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.softmax(attn_weights, dim=-1)
        return self.wo((attn_weights @ v).transpose(1, 2).reshape(bsz, q_len, -1))


class InternLM2ForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(InternLM2Attention(hidden_size) for _ in range(num_layers))
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.tok_embeddings(input_ids)
        mask = _make_causal_mask(input_ids.shape, h.dtype) + _expand_mask(attention_mask, h.dtype)
        for layer in self.layers:
            h = h + layer(h, mask)
        logits = self.output(h)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                           labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss


def main():
    torch.manual_seed(0)
    tokenizer = Tokenizer()
    # token id 0 is a real token ('!' per InternVL#908) inside the first conversation
    samples = [[1, 17, 0, 23, 31, 40], [1, 19, 29, 37]]
    features = [preprocess_internvl2_5(s, tokenizer) for s in samples]
    if FIXED:
        collator = partial(concat_pad_data_collator, pad_id=tokenizer.pad_token_id)
    else:
        collator = concat_pad_data_collator
    batch = collator(features)
    model = InternLM2ForCausalLM()
    with torch.no_grad():
        _, loss = model(**batch)
    print("attention_mask", batch["attention_mask"].int().tolist())
    print("loss %.4f" % loss.item())


if __name__ == "__main__":
    main()
