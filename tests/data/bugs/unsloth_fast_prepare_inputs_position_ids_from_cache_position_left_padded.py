# unslothai/unsloth#4100 (commit 6d0f864369, "Fix/pr 3699 leftpad prefill main"; issue #3699),
# unsloth/models/llama.py _fast_prepare_inputs_for_generation.
# Bug: after building the inputs, the hook set `kwargs["position_ids"] = kwargs["cache_position"]`:
# one arange shared by every row, so in a left-padded batch the shorter prompt's real tokens get
# RoPE positions shifted by its pad count, in prefill and in every decode step.
# Fix: position_ids from the 2-D attention mask (cumsum - 1, pads filled with 1), sliced to the
# tokens of this step; cache_position only when there is no 2-D mask.
# Ported with the hook in front of a tiny GPT-2-layout model (learned absolute positions) so the
# shifted positions show in the output; a pure-RoPE model sees only a uniform shift per row.
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicCache

FIXED = "--fixed" in sys.argv


def _fast_prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
    past_key_values = kwargs.get("past_key_values", None)
    original_attention_mask = attention_mask
    bs, seq_length = input_ids.shape
    device = input_ids.device

    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        bs = input_ids.shape[0]
        input_ids = input_ids[:, [-1]]
        seq_length = 1
        past_len = int(past_key_values.get_seq_length())
        if kwargs.get("cache_position", None) is None:
            kwargs["cache_position"] = torch.arange(
                past_len, past_len + seq_length, device=device, dtype=torch.long
            )

    if not FIXED:
        if "cache_position" in kwargs:
            # (unsloth's fast forward broadcast this 1-D tensor over the batch)
            kwargs["position_ids"] = kwargs["cache_position"].unsqueeze(0).expand(bs, -1)
    else:
        if kwargs.get("position_ids", None) is None:
            if original_attention_mask is not None and original_attention_mask.dim() == 2:
                position_ids = original_attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(original_attention_mask == 0, 1)
                position_ids = position_ids[:, -seq_length:]
                kwargs["position_ids"] = position_ids
            elif kwargs.get("cache_position", None) is not None:
                cp = kwargs["cache_position"]
                if cp.dim() == 1:
                    cp = cp.unsqueeze(0).expand(bs, -1)
                kwargs["position_ids"] = cp

    result = {"attention_mask": attention_mask, **kwargs}
    result["input_ids"] = input_ids
    return result


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    cache = DynamicCache()
    cache_position = torch.arange(input_ids.shape[1])
    for _ in range(max_new_tokens):
        inputs = _fast_prepare_inputs_for_generation(
            model, input_ids, attention_mask=attention_mask,
            past_key_values=cache, cache_position=cache_position, use_cache=True,
        )
        out = model(**inputs)
        cache = out.past_key_values
        next_tok = out.logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_tok], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], -1)
        cache_position = cache_position[-1:] + 1
    return input_ids


def main():
    torch.manual_seed(0)
    # a learned-absolute-position decoder (GPT-2 layout) behind the same hook
    config = GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = GPT2LMHeadModel(config).eval()

    # tokenizer.padding_side = "left", pad = 0
    prompts = [[1, 17, 33, 9], [1, 40, 5, 71, 88, 23, 61, 12]]
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    out = greedy_generate(model, input_ids, attention_mask, max_new_tokens=8)
    for row in out[:, longest:].tolist():
        print(row)


if __name__ == "__main__":
    main()
