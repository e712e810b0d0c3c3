# Written another way than verl#213: a chat PPO loop (OpenRLHF-style) samples with the chat template's stop ids
# (<|im_end|> 7 and the tokenizer's EOS 2), pads the finished responses with the pad id, and builds the mask by
# looking for the tokenizer's EOS alone, row by row: a response stopped at <|im_end|> has no EOS, so its pads stay
# at mask 1 while the pads of a response stopped at the EOS are 0. The critic's values are then read on those pads.
# A Llama critic (eager attention), prompts of one length (no prompt padding), the pad id the tokenizer's.
# Fixed: the mask ends at the first of any stop id.
import sys

import torch
from transformers import LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


class ChatTokenizer:
    pad_token_id, eos_token_id = 0, 2
    im_end_id = 7


class Sampler:
    """Stands in for the inference engine: each response is cut at the first stop id, then right-padded."""

    def __init__(self, responses, stop_token_ids):
        self.responses, self.stop_token_ids = responses, stop_token_ids

    def sample(self, pad, width):
        out = []
        for r in self.responses:
            stop = next(i for i, t in enumerate(r) if t in self.stop_token_ids)
            out.append(r[: stop + 1] + [pad] * (width - stop - 1))
        return torch.tensor(out)


def action_mask(responses, stop_ids):
    mask = torch.ones_like(responses)
    for b, row in enumerate(responses.tolist()):
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        if ends:
            mask[b, ends[0] + 1:] = 0
    return mask


tok = ChatTokenizer()
config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64, pad_token_id=tok.pad_token_id)
config._attn_implementation = "eager"
critic = LlamaModel(config).eval()
value_head = torch.nn.Linear(32, 1)

prompts = torch.tensor([[1, 20, 21, 22], [1, 23, 24, 25], [1, 26, 27, 28]])
sampler = Sampler([[30, 31, 7, 5], [32, 2, 9, 9], [33, 34, 35, 36, 7]], stop_token_ids=[tok.im_end_id, tok.eos_token_id])
responses = sampler.sample(tok.pad_token_id, width=6)
stops = [tok.eos_token_id, tok.im_end_id] if FIXED else [tok.eos_token_id]
sequences = torch.cat([prompts, responses], dim=1)
attention_mask = torch.cat([torch.ones_like(prompts), action_mask(responses, stops)], dim=1)
print("attention_mask:", attention_mask.tolist())
with torch.no_grad():
    hidden = critic(input_ids=sequences, attention_mask=attention_mask).last_hidden_state
    values = value_head(hidden).squeeze(-1)
last = attention_mask.sum(-1) - 1
print("value at each row's last token:", values[torch.arange(3), last].tolist())
