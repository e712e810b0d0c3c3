# NVIDIA-NeMo/Automodel#3704: _package_tokenized_example found padding by stripping *trailing* pad tokens,
# so a left-padding tokenizer (pads in front) got an all-ones attention_mask and every real token attended the
# pad run during SFT; the fix marks the pad positions wherever the tokenizer put them.
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOS, EOS, PAD = 1, 2, 3
SEQ_LENGTH = 16


def _package_tokenized_example(input_ids, assistant_masks, eos_token_id, pad_token_id, seq_length,
                               tokenizer_attention_mask=None):
    labels = input_ids.copy()
    content_length = len(input_ids)
    if FIXED and tokenizer_attention_mask is not None:
        attention_mask = list(tokenizer_attention_mask[:-1])  # aligned with input_ids[:-1]
        input_ids = input_ids[:-1]
    else:
        if pad_token_id is not None and content_length > 0:
            end = content_length
            while end > 0 and input_ids[end - 1] == pad_token_id:
                end -= 1
            if pad_token_id == eos_token_id:
                content_length = min(end + 1, content_length)
            else:
                content_length = end
        input_ids = input_ids[:-1]
        content_length = max(0, min(content_length - 1, len(input_ids)))
        attention_mask = [1] * content_length + [0] * (len(input_ids) - content_length)
    labels[:] = [label if bool(m) else -100 for label, m in zip(labels, assistant_masks)]
    labels = labels[1:]
    attention_mask += [0] * (len(labels) - len(attention_mask))
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def tokenize_left_padded(prompt, answer, max_length):
    """What a padding_side='left' tokenizer returns with padding='max_length'."""
    ids = [BOS] + prompt + answer + [EOS]
    n_pad = max_length - len(ids)
    return {"input_ids": [PAD] * n_pad + ids, "attention_mask": [0] * n_pad + [1] * len(ids)}, n_pad


def format_prompt_completion(prompt, answer):
    tok, n_pad = tokenize_left_padded(prompt, answer, SEQ_LENGTH + 1)
    len_prompt_ids = 1 + len(prompt)
    assistant_masks = [0] * (n_pad + len_prompt_ids) + [1] * (len(answer) + 1)
    return _package_tokenized_example(tok["input_ids"], assistant_masks, EOS, PAD, SEQ_LENGTH,
                                      tokenizer_attention_mask=tok["attention_mask"])


config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config)

examples = [format_prompt_completion([10, 11, 12], [20, 21]),
            format_prompt_completion([13, 14, 15, 16, 17, 18], [22, 23, 24])]
batch = {k: torch.tensor([ex[k] for ex in examples]) for k in ("input_ids", "labels", "attention_mask")}
print("attention_mask[0]:", batch["attention_mask"][0].tolist())

model.train()
out = model(**batch)  # SFT training step
out.loss.backward()

model.eval()
with torch.no_grad():
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = [BOS, 10, 11, 12, 20, 21]  # example 0 without padding
    n_pad = SEQ_LENGTH - len(real)  # same absolute positions as in the padded row
    ref = model(input_ids=torch.tensor([real]), position_ids=torch.arange(n_pad, SEQ_LENGTH)[None]).logits
diff = (logits[0, -len(real):] - ref[0]).abs().max().item()
print("mode:", "fixed" if FIXED else "buggy", "loss %.4f" % out.loss.item())
print("example 0 logits vs unpadded run, max abs diff: %.5f" % diff)
