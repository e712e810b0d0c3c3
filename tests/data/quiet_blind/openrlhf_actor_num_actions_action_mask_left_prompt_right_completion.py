"""OpenRLHF actor log-probs over a left-padded prompt + right-padded completion.

Follows OpenRLHF openrlhf/models/actor.py (Actor.forward: position_ids =
attention_mask.cumsum(-1) - 1, masked_fill(attention_mask == 0, 1); log-probs of
sequences[:, 1:], then the last `num_actions` columns) and
openrlhf/trainer/ppo_utils/experience_maker.py (action_mask = the completion's real
tokens, not the whole attention_mask; policy loss is masked_mean over action_mask),
not pinned. The prompts are left-padded to the longest prompt, the completions
right-padded after EOS. attention_mask hides both paddings; action_mask is on purpose
a different, smaller mask (completion tokens only). Reference: every sample alone,
unpadded, its completion log-probs read directly.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0, eos_token_id=2, bos_token_id=1)
model = LlamaForCausalLM(cfg).eval()
PAD, EOS = 0, 2

prompts = [torch.randint(3, 64, (n,)) for n in (5, 3, 4)]
completions = [torch.cat([torch.randint(3, 64, (n,)), torch.tensor([EOS])]) for n in (2, 5, 3)]
P = max(len(p) for p in prompts)
A = max(len(c) for c in completions)        # num_actions
B = len(prompts)

sequences = torch.full((B, P + A), PAD)
attention_mask = torch.zeros(B, P + A, dtype=torch.long)
for i, (p, c) in enumerate(zip(prompts, completions)):
    sequences[i, P - len(p):P] = p              # left padding of the prompt
    sequences[i, P:P + len(c)] = c              # right padding of the completion
    attention_mask[i, P - len(p):P + len(c)] = 1
# experience_maker: the actions are the completion tokens that were generated
action_mask = attention_mask[:, P:].bool()
num_actions = A


def actor_forward(seqs, mask, n_actions):
    position_ids = mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(mask == 0, 1)
    logits = model(seqs, attention_mask=mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, seqs[:, 1:, None]).squeeze(-1)
    return logp[:, -n_actions:]


with torch.no_grad():
    action_log_probs = actor_forward(sequences, attention_mask, num_actions)
    # a masked mean like the PPO loss reads it
    per_sample = (action_log_probs * action_mask).sum(-1) / action_mask.sum(-1)

    worst = 0.0
    ref_means = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = torch.cat([p, c])[None]
        lp = actor_forward(seq, torch.ones_like(seq), len(c))[0]
        got = action_log_probs[i][action_mask[i]]
        worst = max(worst, (lp - got).abs().max().item())
        ref_means.append(lp.mean())
    worst = max(worst, (per_sample - torch.stack(ref_means)).abs().max().item())

print(f"batched action log-probs vs unpadded one at a time, max diff {worst:.2e}")
assert worst < 1e-4
