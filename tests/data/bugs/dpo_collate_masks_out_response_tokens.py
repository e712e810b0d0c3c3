"""DPO training step whose attention mask hides every response token from attention.

Citation: 0xallam/Direct-Preference-Optimization#1 ("Issue with attention mask"), fixed by
PR #2 / commit d0224dd ("Fix incorrect attention masking"). Upstream file: src/train.py.

Bug: `collate_fn` concatenated prompt ids with chosen / rejected ids and built the attention
mask as `torch.cat([torch.ones_like(prompt_ids), torch.zeros_like(prefered_ids)], dim=-1)`:
every response token was marked as padding, so no query could attend to any response token
(each response token saw only the prompt), and the tokenizer's own padding mask was dropped.

Fix: keep the tokenizer's attention masks and concatenate them
(`torch.cat([prompt_encodings.attention_mask, chosen_encodings.attention_mask], dim=-1)`).
The fix also moved to `padding='max_length'` and a response-only log-prob; this program keeps
`padding=True` in both modes so only the mask lines differ.

Reproduction: the upstream model is `microsoft/phi-2` loaded with AutoModelForCausalLM; here a
small causal LM with random weights stands in for it and treats `attention_mask` the way the
Hugging Face models do (1 = attend, 0 = padding key, combined with the causal mask and passed to
F.scaled_dot_product_attention). A word-level stand-in tokenizer (right padding with the eos id
as pad, as `tokenizer.pad_token = tokenizer.eos_token` does upstream) replaces the downloaded
one. One DPO loss is computed for a batch of two preference pairs.
"""
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class CausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


class Block(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.ln = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x, mask):
        b, t, d = x.shape
        h = self.ln(x)
        q, k, v = self.qkv(h).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = self.dense(attn.transpose(1, 2).reshape(b, t, d))
        return x + attn + self.mlp(h)


class TinyCausalLM(nn.Module):
    """Stand-in for AutoModelForCausalLM: `attention_mask` is (batch, seq) with 1 = attend."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList([Block(hidden_size, num_heads) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids, attention_mask=None):
        t = input_ids.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return CausalLMOutput(self.lm_head(x))


class WordTokenizer:
    """Stand-in for the phi-2 tokenizer: one id per whitespace word, right padding."""

    def __init__(self, words):
        self.vocab = {w: i + 1 for i, w in enumerate(sorted(words))}
        self.eos_token_id = 0
        self.pad_token_id = 0

    def batch_encode_plus(self, texts, padding=True, return_tensors="pt", max_length=None, truncation=True):
        ids = [[self.vocab[w] for w in t.split()][:max_length] for t in texts]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
            attention_mask[i, : len(x)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def calculate_DPO_loss(model_prefered_logprob, model_disprefered_logprob,
                       ref_prefered_logprob, ref_disprefered_logprob, beta=0.5):
    prefered_relative_logprob = model_prefered_logprob - ref_prefered_logprob
    disprefered_relative_logprob = model_disprefered_logprob - ref_disprefered_logprob
    reward_accuracies = (prefered_relative_logprob > disprefered_relative_logprob).float().mean(dim=-1)
    reward_margins = (prefered_relative_logprob - disprefered_relative_logprob).mean(dim=-1)
    loss = -F.logsigmoid(beta * (prefered_relative_logprob - disprefered_relative_logprob)).mean(dim=-1)
    return loss, prefered_relative_logprob.mean(dim=-1), disprefered_relative_logprob.mean(dim=-1), reward_accuracies, reward_margins


def get_log_prob(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return torch.gather(log_probs, -1, labels.unsqueeze(-1)).squeeze(-1).mean(-1)


def collate_fn(batch, tokenizer, max_length, device):
    prompts = ['Instruct: ' + item['prompt'] + '\n' for item in batch]
    chosen_responses = ['Output: ' + item['chosen'] for item in batch]
    rejected_responses = ['Output: ' + item['rejected'] for item in batch]

    prompt_enc = tokenizer.batch_encode_plus(prompts, padding=True, return_tensors="pt", max_length=max_length, truncation=True)
    prefered_enc = tokenizer.batch_encode_plus(chosen_responses, padding=True, return_tensors="pt", max_length=max_length, truncation=True)
    disprefered_enc = tokenizer.batch_encode_plus(rejected_responses, padding=True, return_tensors="pt", max_length=max_length, truncation=True)
    prompt_ids = prompt_enc['input_ids'].to(device)
    prefered_ids = prefered_enc['input_ids'].to(device)
    disprefered_ids = disprefered_enc['input_ids'].to(device)

    prompt_prefered_ids = torch.cat([prompt_ids, prefered_ids], dim=-1)
    prompt_disprefered_ids = torch.cat([prompt_ids, disprefered_ids], dim=-1)

    if FIXED:
        prompt_prefered_mask = torch.cat([prompt_enc['attention_mask'], prefered_enc['attention_mask']], dim=-1).to(device)
        prompt_disprefered_mask = torch.cat([prompt_enc['attention_mask'], disprefered_enc['attention_mask']], dim=-1).to(device)
    else:
        prompt_prefered_mask = torch.cat([torch.ones_like(prompt_ids), torch.zeros_like(prefered_ids)], dim=-1)
        prompt_disprefered_mask = torch.cat([torch.ones_like(prompt_ids), torch.zeros_like(disprefered_ids)], dim=-1)

    return {'prompt_prefered_ids': prompt_prefered_ids,
            'prompt_disprefered_ids': prompt_disprefered_ids,
            'prompt_prefered_mask': prompt_prefered_mask,
            'prompt_disprefered_mask': prompt_disprefered_mask}


def train_step(model, ref_model, batch, beta=0.1):
    prompt_prefered_ids = batch['prompt_prefered_ids']
    prompt_disprefered_ids = batch['prompt_disprefered_ids']
    prompt_prefered_mask = batch['prompt_prefered_mask']
    prompt_disprefered_mask = batch['prompt_disprefered_mask']

    model_prefered_log_prob = get_log_prob(model(prompt_prefered_ids, attention_mask=prompt_prefered_mask).logits, prompt_prefered_ids)
    model_disprefered_log_prob = get_log_prob(model(prompt_disprefered_ids, attention_mask=prompt_disprefered_mask).logits, prompt_disprefered_ids)
    with torch.no_grad():
        ref_prefered_log_prob = get_log_prob(ref_model(prompt_prefered_ids, attention_mask=prompt_prefered_mask).logits, prompt_prefered_ids)
        ref_disprefered_log_prob = get_log_prob(ref_model(prompt_disprefered_ids, attention_mask=prompt_disprefered_mask).logits, prompt_disprefered_ids)

    return calculate_DPO_loss(model_prefered_log_prob, model_disprefered_log_prob,
                              ref_prefered_log_prob, ref_disprefered_log_prob, beta=beta)


def main():
    torch.manual_seed(2003)
    data = [
        {"prompt": "is the earth flat ?", "chosen": "no it is round", "rejected": "yes it is flat and wide"},
        {"prompt": "name a color", "chosen": "blue", "rejected": "a number like seven"},
    ]
    words = set()
    for item in data:
        for text in ('Instruct: ' + item['prompt'], 'Output: ' + item['chosen'], 'Output: ' + item['rejected']):
            words.update(text.split())
    tokenizer = WordTokenizer(words)
    model = TinyCausalLM().eval()
    ref_model = TinyCausalLM().eval()
    ref_model.requires_grad_(False)

    collate = partial(collate_fn, tokenizer=tokenizer, max_length=512, device="cpu")
    batch = collate(data)
    loss, pref_rel, dispref_rel, acc, margin = train_step(model, ref_model, batch)
    print("dpo loss %.5f reward margin %.5f" % (loss.item(), margin.item()))


if __name__ == "__main__":
    main()
