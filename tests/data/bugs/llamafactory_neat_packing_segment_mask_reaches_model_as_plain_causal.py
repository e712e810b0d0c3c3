# hiyouga/LlamaFactory#4224 (neat_packing, review by hiyouga): the first version patched
# transformers' _prepare_4d_causal_attention_mask, which Llama's forward never calls, so the packed segment-index
# mask [1,1,1,2,2,...] reached sdpa as a plain all-ones causal mask and packed samples attended each other;
# the merged version builds the block-diagonal 4D mask in the data collator (prepare_4d_attention_mask).
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def prepare_4d_attention_mask(attention_mask_with_indices, dtype):
    r"""
    Expands the attention mask with indices from (batch_size, seq_len) to (batch_size, 1, seq_len, seq_len),
    while handles packed sequences and transforms the mask to lower triangular form to prevent future peeking.

    e.g.
    ```
    [[1, 1, 2, 2, 2, 0]]
    ```
    ->
    ```
    [[[[o, x, x, x, x, x],
       [o, o, x, x, x, x],
       [x, x, o, x, x, x],
       [x, x, o, o, x, x],
       [x, x, o, o, o, x],
       [x, x, x, x, x, x]]]]
    ```
    where `o` equals to `0.0`, `x` equals to `min_dtype`.
    """
    bsz, seq_len = attention_mask_with_indices.size()
    min_dtype = torch.finfo(dtype).min
    expanded_mask = attention_mask_with_indices[:, None, None, :].expand(bsz, 1, seq_len, seq_len)
    # Create a binary mask from the original mask where zeros remain zeros and all other values are set to one
    padding_mask = torch.where(expanded_mask != 0, 1, 0)
    # Create a block-diagonal mask.
    attention_mask_4d = torch.eq(expanded_mask, expanded_mask.transpose(-1, -2)).int() * padding_mask
    # Use the lower triangular mask to zero out the upper triangular part
    attention_mask_4d *= torch.tril(torch.ones((seq_len, seq_len), dtype=torch.long))
    # Invert the attention mask.
    attention_mask_4d = torch.where(attention_mask_4d != 0, torch.tensor(0, dtype=dtype), min_dtype)
    return attention_mask_4d


class SFTDataCollatorWith4DAttentionMask:
    def __init__(self, block_diag_attn=False, compute_dtype=torch.float32):
        self.block_diag_attn = block_diag_attn
        self.compute_dtype = compute_dtype

    def __call__(self, features):
        batch = {k: torch.tensor([f[k] for f in features]) for k in features[0]}
        if self.block_diag_attn and FIXED:
            batch["attention_mask"] = prepare_4d_attention_mask(batch["attention_mask"], self.compute_dtype)
        return batch


def pack_examples(examples, cutoff_len, pad_token_id=0):
    """neat_packing: concatenate samples, attention_mask carries the 1-based index of each sample."""
    input_ids, labels, attention_mask, position_ids = [], [], [], []
    for i, (ids, lbl) in enumerate(examples):
        input_ids += ids
        labels += lbl
        attention_mask += [i + 1] * len(ids)
        position_ids += list(range(len(ids)))
    n_pad = cutoff_len - len(input_ids)
    return {"input_ids": input_ids + [pad_token_id] * n_pad, "labels": labels + [-100] * n_pad,
            "attention_mask": attention_mask + [0] * n_pad, "position_ids": position_ids + [0] * n_pad}


config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config)

sample_a = ([1, 10, 11, 12, 13, 2], [-100, -100, 11, 12, 13, 2])
sample_b = ([1, 20, 21, 22, 2], [-100, -100, 21, 22, 2])
collator = SFTDataCollatorWith4DAttentionMask(block_diag_attn=True)  # neat_packing: true
batch = collator([pack_examples([sample_a, sample_b], cutoff_len=14)])

model.train()
out = model(**batch)
out.loss.backward()

model.eval()
with torch.no_grad():
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    ref = model(input_ids=torch.tensor([sample_b[0]])).logits  # sample b trained alone
start = len(sample_a[0])
diff = (logits[0, start:start + len(sample_b[0])] - ref[0]).abs().max().item()
print("mode:", "fixed" if FIXED else "buggy", "loss %.4f" % out.loss.item())
print("packed sample b vs sample b alone, max abs diff: %.5f" % diff)
