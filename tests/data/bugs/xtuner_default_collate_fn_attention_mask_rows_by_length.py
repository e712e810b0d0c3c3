# xtuner (InternLM/xtuner#829, commit 16e2f8f1a): default_collate_fn builds the padding attention_mask with
# `for i in ori_length: attention_mask[:i] = True`, which fills whole batch rows (indexed by a length) instead of the
# first `length` columns of row i, so every padded slot of every sample is marked as a real token.
# (The same pattern in preference_collate_fn was fixed separately in #859; this is the SFT collator.)
import sys

import torch
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DEFAULT_PAD_TOKEN_INDEX = 0
IGNORE_INDEX = -100


def get_sequence_parallel_world_size():
    return 1


def default_collate_fn(instances, pad_index=DEFAULT_PAD_TOKEN_INDEX, return_hf_format=False, use_varlen_attn=False):
    input_ids, labels = [], []
    for example in instances:
        input_ids.append(torch.LongTensor(example["input_ids"]))
        labels.append(torch.LongTensor(example["labels"]))

    ori_length = [len(ids) for ids in input_ids]
    if len(instances) > 1:
        input_ids = pad_sequence(input_ids, batch_first=True, padding_value=pad_index)
        labels = pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    else:
        input_ids = torch.stack(input_ids)
        labels = torch.stack(labels)

    # Some tokenizers have the same eos token and pad token, so input_ids
    # cannot be masked directly based on the pad token id.
    attention_mask = torch.zeros_like(input_ids).bool()
    if FIXED:
        for i, length in enumerate(ori_length):
            attention_mask[i, :length] = True
    else:
        for i in ori_length:
            attention_mask[:i] = True

    bs, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).unsqueeze(0).long().repeat(bs, 1)

    data_dict = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}
    if return_hf_format:
        return data_dict
    return {"data": data_dict, "data_samples": None}


from transformers import LlamaConfig, LlamaForCausalLM  # xtuner SFT wraps an HF causal LM

config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
)
config._attn_implementation = "eager"
model = LlamaForCausalLM(config).eval()

lengths = [5, 12, 8]
instances = []
for n in lengths:
    ids = torch.randint(1, 64, (n,)).tolist()
    instances.append({"input_ids": ids, "labels": ids})

data = default_collate_fn(instances, return_hf_format=True)
mask = data["attention_mask"]
true_mask = torch.zeros_like(mask)
for i, n in enumerate(lengths):
    true_mask[i, :n] = True

with torch.no_grad():
    out = model(input_ids=data["input_ids"], attention_mask=mask.long(), position_ids=data["position_ids"]).logits
    ref = model(input_ids=data["input_ids"], attention_mask=true_mask.long(), position_ids=data["position_ids"]).logits

pad_slots_marked_real = int((mask & ~true_mask).sum())
pad = ~true_mask
diff_pad = (out - ref).abs()[pad].max().item()
print(f"padded slots marked as real tokens in attention_mask: {pad_slots_marked_real}")
print(f"max |logits(collated mask) - logits(per-sample length mask)| at padded positions = {diff_pad:.6f}")
