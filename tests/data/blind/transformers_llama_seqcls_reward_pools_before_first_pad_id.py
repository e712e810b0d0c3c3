# huggingface/transformers#35911 (issue #35909), LlamaForSequenceClassification.forward (the reward head TRL's
# RewardTrainer trains). Bug: the pooled "last token" is the one before the FIRST pad_token_id, so when pad == an
# in-text special token (eos/<|im_end|> at turn boundaries) the reward is read from inside the prompt.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LlamaForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.model(input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.score(hidden_states)
        batch_size = input_ids.shape[0]
        if FIXED:
            # To handle both left- and right- padding, we take the rightmost token that is not equal to pad_token_id
            non_pad_mask = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
            token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
        else:
            # if no pad token found, use modulo instead of reverse indexing for ONNX compatibility
            sequence_lengths = torch.eq(input_ids, self.config.pad_token_id).int().argmax(-1) - 1
            sequence_lengths = sequence_lengths % input_ids.shape[-1]
            last_non_pad_token = sequence_lengths.to(logits.device)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]
        return pooled_logits, logits


IM_END = 2  # chat template turn terminator, also used as pad token (tokenizer.pad_token = tokenizer.eos_token)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                  pad_token_id=IM_END, eos_token_id=IM_END, bos_token_id=1)
cfg._attn_implementation = "eager"
model = LlamaForSequenceClassification(cfg).eval()

g = torch.Generator().manual_seed(1)
rnd = lambda n: torch.randint(3, 64, (n,), generator=g).tolist()


def chat(prompt, completion):  # "<user> ... <|im_end|> <assistant> ... <|im_end|>"
    return [1] + prompt + [IM_END] + completion + [IM_END]


def collate(seqs):  # right padding, as RewardDataCollatorWithPadding
    L = max(map(len, seqs))
    ids = torch.tensor([s + [IM_END] * (L - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    return ids, att


prompts = [rnd(4), rnd(6), rnd(3)]
chosen = [chat(p, rnd(5)) for p in prompts]
rejected = [chat(p, rnd(3)) for p in prompts]
with torch.no_grad():
    ids_c, att_c = collate(chosen)
    ids_r, att_r = collate(rejected)
    rewards_chosen, logits_c = model(ids_c, att_c)
    rewards_rejected, logits_r = model(ids_r, att_r)
    loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    # reference: score at the last completion token (the one just before the final <|im_end|>)
    before_c = logits_c[torch.arange(3), att_c.sum(-1) - 2]
    before_r = logits_r[torch.arange(3), att_r.sum(-1) - 2]
    diff = max((rewards_chosen - before_c).abs().max().item(), (rewards_rejected - before_r).abs().max().item())

print(f"reward loss: {loss.item():.6f}")
print(f"max |pooled reward - score at the last completion token|: {diff:.6e}")
