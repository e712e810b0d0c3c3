# CarperAI/trlx#509 (commit fbc9e04), trlx/trainer/accelerate_ppo_trainer.py make_experience.
# Bug: policy and reference-model forwards on left-padded [prompt|response] pass the attention_mask but no
# position_ids derived from it, so every padded row is scored at positions shifted by its pad count.
import sys
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def logprobs_of_labels(logits, labels):
    logprobs = F.log_softmax(logits, dim=-1)
    return torch.gather(logprobs, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=PAD,
                 bos_token_id=1, eos_token_id=PAD)
cfg._attn_implementation = "eager"
model = GPT2LMHeadModel(cfg).eval()
ref_model = GPT2LMHeadModel(cfg).eval()

g = torch.Generator().manual_seed(1)
rnd = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()
prompts = [rnd(7), rnd(3), rnd(5)]
responses = [rnd(6), rnd(4), rnd(6)]
P = max(map(len, prompts))
R = max(map(len, responses))
# trlx: prompts left-padded by the tokenizer, generated samples right-padded with pad_token_id
prompt_tensors = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
sample_outputs = torch.tensor([r + [PAD] * (R - len(r)) for r in responses])


def make_experience_logprobs(m):
    all_tokens = torch.cat((prompt_tensors, sample_outputs), dim=1)
    attention_mask = all_tokens.not_equal(PAD).long()
    with torch.no_grad():
        if FIXED:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            logits = m(all_tokens, attention_mask=attention_mask, position_ids=position_ids, return_dict=True).logits
        else:
            logits = m(all_tokens, attention_mask=attention_mask, return_dict=True).logits
    return logprobs_of_labels(logits[:, :-1, :], all_tokens[:, 1:])


logprobs = make_experience_logprobs(model)
ref_logprobs = make_experience_logprobs(ref_model)
log_ratio = logprobs - ref_logprobs
start = P - 1
kl = [(log_ratio[i, start:start + len(r)]).sum().item() for i, r in enumerate(responses)]

# reference: each prompt+response alone, no padding
worst = 0.0
for i, (p, r) in enumerate(zip(prompts, responses)):
    toks = torch.tensor([p + r])
    with torch.no_grad():
        lp = logprobs_of_labels(ref_model(toks).logits[:, :-1], toks[:, 1:])[0, len(p) - 1:]
    worst = max(worst, (ref_logprobs[i, start:start + len(r)] - lp).abs().max().item())

print("per-sample KL(policy||ref) sums:", [round(k, 5) for k in kl])
print(f"max |batched ref logprobs - each sequence alone|: {worst:.6e}")
