"""huggingface/transformers#46634: a padding-free batch (DataCollatorWithFlattening, which gives position_ids and the
flash kwargs cu_seq_lens_q/k) handed to an SDPA model together with an all-ones 2-D attention_mask, as verl-style
trainers pass it. masking_utils only reads packed documents from position_ids when attention_mask is None
(_preprocess_mask_arguments), so SDPA took its is_causal path and each sequence attended to the ones before it in the
row; cu_seq_lens is read by the flash path alone. The fix drops the all-ones mask, which says nothing in a flattened
batch (huggingface/trl#3997)."""

import sys

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, attn_implementation="sdpa")
torch.manual_seed(0)
model = LlamaForCausalLM(config)
collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7]}, {"input_ids": [8, 9]}])
if not FIXED:
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
loss = model(**batch, use_cache=False).loss  # a training step: no cache
loss.backward()
