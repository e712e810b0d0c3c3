# huggingface/transformers#22828 ("XGLM: Fix left-padding (PT and TF)", fixes #22707). XGLM is the architecture
# InCoder (facebook/incoder-1B/6B) is served with; batched infilling prompts are left-padded for generation.
# Before the fix XGLM took no position_ids: XGLMSinusoidalPositionalEmbedding built them from the input ids,
# create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length), i.e. cumsum of non-pad tokens
# + past length. On the prompt this skips the left pads, but once generation feeds one token with the KV cache, the
# position is past_key_values_length + 1, and past_key_values_length counts the pad slots: every row of a left-padded
# batch jumps forward by its number of pads between prefill and the first decoded token (the attention mask still
# hides the pads). prepare_inputs_for_generation did not build position_ids either.
# The fix adds position_ids to XGLM (embedding = sinusoid[position_ids + offset]) and prepare_inputs_for_generation
# derives them from the attention mask: attention_mask.cumsum(-1) - 1, pads filled with 1, last column when cached.
# Here a tiny XGLMForCausalLM from a config; the pre-fix embedding positions are computed by the pre-fix helper and
# handed to the model (minus the embedding's offset), the greedy cached loop is GenerationMixin's, written out.
import sys

import torch
from transformers import XGLMConfig, XGLMForCausalLM

FIXED = "--fixed" in sys.argv

PAD = 1          # XGLM / InCoder pad id, also the sinusoidal table's padding_idx
OFFSET = 2       # XGLMSinusoidalPositionalEmbedding.offset


def create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length=0):
    """Pre-fix modeling_xglm helper (copied from fairseq's utils.make_positions)."""
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
    return incremental_indices.long() + padding_idx


def prepare_inputs_for_generation(input_ids, past_key_values=None, attention_mask=None, use_cache=None, **kwargs):
    if FIXED:
        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values:
                position_ids = position_ids[:, -1].unsqueeze(-1)
        else:
            position_ids = None
    else:
        position_ids = None   # the model derives its positions from input_ids and the cache length
    # first step, decoder_cached_states are empty
    if attention_mask is None:
        attention_mask = input_ids.new_ones(input_ids.shape)
    if past_key_values:
        input_ids = input_ids[:, -1:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "past_key_values": past_key_values, "use_cache": use_cache}


def xglm_forward(model, input_ids, attention_mask, position_ids, past_key_values, use_cache):
    past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
    if position_ids is None:
        # pre-fix XGLMSinusoidalPositionalEmbedding.forward: positions from the ids and the cache length
        position_ids = create_position_ids_from_input_ids(input_ids, PAD, past_key_values_length) - OFFSET
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=past_key_values, use_cache=use_cache)


torch.manual_seed(0)
config = XGLMConfig(vocab_size=64, d_model=32, ffn_dim=64, num_layers=2, attention_heads=2,
                    max_position_embeddings=64, pad_token_id=PAD, bos_token_id=0, eos_token_id=2,
                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
model = XGLMForCausalLM(config).eval()

# InCoder infilling prompts: <left> <|mask:0|> <right> <|mask:0|>, token ids stand for the BPE pieces
MASK0 = 60
prompts = [
    [0, 11, 12, 13, 14, 15, 16, 17, MASK0, 21, 22, 23, 24, MASK0],   # long file
    [0, 31, 32, MASK0, 33, MASK0],                                   # short file
]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts])               # padding_side="left"
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

generated = input_ids
past_key_values = None
step_logits = []
with torch.no_grad():
    for _ in range(6):
        inputs = prepare_inputs_for_generation(generated, past_key_values=past_key_values,
                                               attention_mask=attention_mask, use_cache=True)
        out = xglm_forward(model, **inputs)
        past_key_values = out.past_key_values
        logits = out.logits[:, -1, :]
        step_logits.append(logits)
        next_tokens = logits.argmax(-1)
        generated = torch.cat([generated, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)

print("fixed" if FIXED else "buggy", "step-2 logits of the short (left-padded) prompt [:4]:",
      [round(v, 4) for v in step_logits[1][1, :4].tolist()])
print("infilled tokens:", generated[:, max_len:].tolist())
