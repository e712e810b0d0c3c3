# Correct program (quiet batch quiet-ya).
# Ported from allenai/open-instruct @005366f75dc8ac5e1dc0e9fb67d3d9ef881ea850,
# open_instruct/padding_free_collator.py (TensorDataCollatorWithFlattening: examples concatenated into one
# row, labels = [separator_id=-100] + item["labels"][1:] per example, cu_seq_lens_q/k, max_length_q/k,
# position_ids restarting at 0, seq_idx, and the max_seq_length tail padded with input 0 / label -100 /
# position 0 / seq_idx -1 outside every cu_seq_lens span), used as open_instruct/finetune.py does for
# padding_free SFT: the batch goes straight into a LlamaForCausalLM running FlashAttention-2 (varlen over
# cu_seq_lens, causal). Each example's prompt tokens carry label -100 (the chat SFT tokenizer's masking).
# No flash-attn on CPU: a stand-in with flash_attn_varlen_func's arguments is registered as the model's
# attention (it reads cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k from the forward kwargs,
# runs each span causally and leaves tokens outside every span at zero, as the kernel does not write them),
# and, like flash_attention_2, no mask tensor is built for it.
# Self-check: every example run alone, unpadded, through the same weights with eager attention; logits of
# every real token and the summed token loss (prompt tokens excluded) must match the packed batch's.
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

torch.manual_seed(0)


class TensorDataCollatorWithFlattening:
    return_flash_attn_kwargs = True
    return_position_ids = True
    return_seq_idx = True
    separator_id = -100

    def __init__(self, max_seq_length=None):
        self.max_seq_length = max_seq_length

    def __call__(self, features, separator_id=None):
        if separator_id is None:
            separator_id = self.separator_id
        cu_seq_lens = [0]
        max_length = 0
        pos_ids, seq_idx = [], []
        is_labels_provided = "labels" in features[0]
        ret = {"input_ids": [], "labels": []}
        separator = torch.tensor([separator_id], dtype=features[0]["input_ids"].dtype)
        for s_idx, item in enumerate(features):
            input_ids = item["input_ids"]
            ret["input_ids"].append(input_ids)
            ret["labels"].append(separator)
            ret["labels"].append(item["labels"][1:] if is_labels_provided else input_ids[1:])
            cu_seq_lens.append(cu_seq_lens[-1] + len(input_ids))
            max_length = max(max_length, len(input_ids))
            pos_ids.append(torch.arange(input_ids.numel()))
            seq_idx.append(torch.full_like(input_ids, s_idx, dtype=torch.int32))
        ret["cu_seq_lens_q"] = ret["cu_seq_lens_k"] = torch.tensor(cu_seq_lens, dtype=torch.int32)
        ret["max_length_q"] = ret["max_length_k"] = max_length
        position_ids_tensor = torch.cat(pos_ids, dim=0)[None]
        seq_idx_tensor = torch.cat(seq_idx, dim=0)[None]
        input_ids_tensor = torch.cat(ret["input_ids"], dim=0)[None]
        labels_tensor = torch.cat(ret["labels"], dim=0)[None]
        num_valid_seqs = len(features)
        if self.max_seq_length is not None:
            current_len = input_ids_tensor.shape[1]
            assert current_len <= self.max_seq_length     # truncation branch not exercised here
            if current_len < self.max_seq_length:
                pad_len = self.max_seq_length - current_len
                input_ids_tensor = F.pad(input_ids_tensor, (0, pad_len), value=0)
                labels_tensor = F.pad(labels_tensor, (0, pad_len), value=-100)
                position_ids_tensor = F.pad(position_ids_tensor, (0, pad_len), value=0)
                seq_idx_tensor = F.pad(seq_idx_tensor, (0, pad_len), value=-1)
        ret["input_ids"] = input_ids_tensor
        ret["labels"] = labels_tensor
        ret["_num_valid_seqs"] = num_valid_seqs
        ret["position_ids"] = position_ids_tensor
        ret["seq_idx"] = seq_idx_tensor
        return ret


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False):
    # CPU stand-in: q/k/v are (total_tokens, heads, head_dim); spans outside cu_seqlens are not written
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                           v[ks:ke].transpose(0, 1), scale=softmax_scale, is_causal=causal)
        out[qs:qe] = o.transpose(0, 1)
    return out


def varlen_standin_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                                     max_length_k=None, **kwargs):
    # query (1, heads, total, d), key/value (1, kv_heads, total, d)
    assert query.shape[0] == 1 and cu_seq_lens_q is not None
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = flash_attn_varlen_func(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                                 dropout_p=dropout, softmax_scale=scaling, causal=module.is_causal)
    return out[None], None          # (1, total, heads, d)


def no_mask_like_flash(*args, **kwargs):
    return None


AttentionInterface.register("varlen_standin", varlen_standin_attention_forward)
AttentionMaskInterface.register("varlen_standin", no_mask_like_flash)

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config).eval()


def sft_example(prompt_len, total_len):
    ids = torch.randint(3, 64, (total_len,))
    labels = ids.clone()
    labels[:prompt_len] = -100          # prompt tokens are not trained on
    return {"input_ids": ids, "labels": labels}


features = [sft_example(4, 9), sft_example(6, 7), sft_example(2, 12), sft_example(5, 6)]
batch = TensorDataCollatorWithFlattening(max_seq_length=40)(features)
assert batch["input_ids"].shape[1] == 40 and int(batch["cu_seq_lens_q"][-1]) == 34

with torch.no_grad():
    model.set_attn_implementation("varlen_standin")
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"])
    packed_logits = out.logits[0]
    shift_logits, shift_labels = packed_logits[:-1], batch["labels"][0, 1:]
    packed_loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    packed_count = (shift_labels != -100).sum()

    model.set_attn_implementation("eager")
    ref_loss_sum, ref_count = 0.0, 0
    cu = batch["cu_seq_lens_q"].tolist()
    for i, f in enumerate(features):
        ref = model(input_ids=f["input_ids"][None]).logits[0]
        assert torch.allclose(packed_logits[cu[i]:cu[i + 1]], ref, atol=1e-5), i
        lab = f["labels"][1:]
        ref_loss_sum = ref_loss_sum + F.cross_entropy(ref[:-1], lab, ignore_index=-100, reduction="sum")
        ref_count += int((lab != -100).sum())
    assert int(packed_count) == ref_count
    assert torch.allclose(packed_loss_sum, ref_loss_sum, atol=1e-4), (packed_loss_sum, ref_loss_sum)
print("ok", ref_count, "trained tokens")
