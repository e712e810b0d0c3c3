"""TRL RLOO with pad id == eos id: the attention mask comes from lengths, not from `ids != pad`.

Follows huggingface/trl's RLOO/PPO trainers (trl/trainer/rloo_trainer.py, trl/trainer/utils.py first_true_indices,
truncate_response). Many tokenizers ship pad_token = eos_token, so `query_responses != pad_token_id` would also hide
the real EOS that ends each completion, and the reward/logprob of the last token would read a masked position.
Done right here: the prompt mask comes from the tokenizer (left padding), the completion length is the index of
the first EOS plus one (the EOS is kept), and everything after it is padding. Mask meant: causal attention over
the left-padded prompt and the completion up to and including its first EOS; RLOO baseline over k completions.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
EOS = PAD = 2


def first_true_indices(bools, dtype=torch.long):
    """Index of the first True per row, or the row length if none (trl.trainer.utils)."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


class Block(nn.Module):
    def __init__(self, d=32, heads=4, vocab=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.score = nn.Linear(d, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        t = input_ids.shape[1]
        h = self.emb(input_ids) + self.pos(position_ids)
        bias = torch.zeros(input_ids.shape[0], t, t)
        bias.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        # finite minimum for padding keys (as HF does) so a left-pad query row does not turn into NaN
        bias.masked_fill_(~attention_mask.bool()[:, None, :], torch.finfo(bias.dtype).min)
        bias = bias.repeat_interleave(self.attn.num_heads, 0)
        o, _ = self.attn(h, h, h, attn_mask=bias, need_weights=False)
        h = h + o
        return self.head(h), self.score(h).squeeze(-1)


def main():
    rloo_k = 2
    prompt = [[7, 8, 9], [PAD, 7, 11]]  # tokenizer left-pads the prompt
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    queries = torch.tensor(prompt).repeat(rloo_k, 1)
    prompt_mask = prompt_mask.repeat(rloo_k, 1)
    # sampled completions; generation keeps emitting EOS (== PAD) after it stops
    responses = torch.tensor([
        [12, 13, EOS, EOS, EOS],
        [14, EOS, EOS, EOS, EOS],
        [15, 16, 17, 18, EOS],
        [19, 20, 21, 22, 23],   # hit max_new_tokens without EOS
    ])
    eos_at = first_true_indices(responses == EOS)
    resp_len = torch.clamp(eos_at + 1, max=responses.shape[1])  # keep the EOS itself
    response_mask = torch.arange(responses.shape[1])[None] < resp_len[:, None]
    attention_mask = torch.cat([prompt_mask.bool(), response_mask], 1)
    query_responses = torch.cat([queries, responses], 1)
    position_ids = (attention_mask.cumsum(1) - attention_mask.long()).clamp(min=0)

    model = Block()
    logits, scores = model(query_responses, attention_mask, position_ids)
    ctx = queries.shape[1]
    logits = logits[:, ctx - 1:-1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)
    logprobs = logprobs.masked_fill(~response_mask, 0.0)  # INVALID_LOGPROB positions dropped from the sum
    # reward read at the last real token (the first EOS), right after the prompt block
    seq_end = ctx + resp_len - 1
    rewards = scores[torch.arange(scores.shape[0]), seq_end]
    no_eos = ~(responses == EOS).any(1)
    rewards = torch.where(no_eos, torch.full_like(rewards, -1.0), rewards)  # missing_eos_penalty
    rewards = rewards.reshape(rloo_k, -1)
    baseline = (rewards.sum(0) - rewards) / (rloo_k - 1)
    advantages = (rewards - baseline).flatten()
    loss = -(advantages.detach() * logprobs.sum(1)).mean()
    assert torch.isfinite(loss)
    print("resp_len", resp_len.tolist(), f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
