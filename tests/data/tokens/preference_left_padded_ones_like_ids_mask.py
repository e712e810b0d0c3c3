# Written another way: the bug of PKU-Alignment/align-anything#96 (a preference collator that rebuilds the mask as
# ones over ids the processor had already LEFT-padded) in a plain text DPO loop: chosen and rejected rows padded on
# the left by flipping, `pad_sequence` and flipping back, a Qwen2 policy. Bug: `torch.ones_like(input_ids)`, so each
# real token attends to the pads before it; the fix marks the pads 0 from each sequence's own length.
import sys

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
PAD = 3


def left_pad(seqs):
    flipped = [torch.tensor(s).flip(0) for s in seqs]
    return pad_sequence(flipped, batch_first=True, padding_value=PAD).flip(1)


def preference_batch(pairs):
    seqs = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
    input_ids = left_pad(seqs)
    if FIXED:
        lengths = torch.tensor([len(s) for s in seqs])
        width = input_ids.shape[1]
        attention_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    else:
        attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1,
                     eos_token_id=2, attn_implementation="eager")
torch.manual_seed(0)
policy = Qwen2ForCausalLM(config).eval()

pairs = [([1, 10, 11], [20, 21, 22, 2], [23, 2]),
         ([1, 12, 13, 14, 15], [24, 25, 2], [26, 27, 28, 29, 2])]
input_ids, attention_mask = preference_batch(pairs)
with torch.no_grad():
    logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
logps = logits.log_softmax(-1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
print("sequence log-probs:", [round(v, 4) for v in (logps * attention_mask[:, 1:]).sum(-1).tolist()])
