"""PPO value head sharing the policy's forward (TRL AutoModelForCausalLMWithValueHead) over a left-padded batch.

Follows huggingface/trl's trl/models/modeling_value_head.py (ValueHead on the last hidden state of the same
forward that yields the policy logits) and the PPO step (GAE over response tokens only). The model is a
transformers LlamaForCausalLM built from a LlamaConfig with random weights, called with the tokenizer's
attention_mask (prompt left-padded, completion right-padded after its EOS) and position ids counted over real
tokens. Mask meant: causal attention over real tokens; padding hidden as keys; values and advantages read only at
completion tokens.
"""
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


class ValueHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.summary = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states):
        return self.summary(self.dropout(hidden_states)).squeeze(-1)


class AutoModelForCausalLMWithValueHead(nn.Module):
    def __init__(self, pretrained_model):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(pretrained_model.config)

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, output_hidden_states=True)
        value = self.v_head(out.hidden_states[-1])
        return out.logits, value


def main():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=2, bos_token_id=1)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLMWithValueHead(LlamaForCausalLM(cfg)).eval()

    queries = torch.tensor([[0, 0, 1, 9, 10], [1, 11, 12, 13, 14]])
    query_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    responses = torch.tensor([[20, 21, 2, 0], [22, 2, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    input_ids = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, response_mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)

    with torch.no_grad():
        logits, values = model(input_ids, attention_mask, position_ids)
    ctx = queries.shape[1]
    values = values[:, ctx - 1:-1]  # value of the state before each response token
    logprobs = torch.log_softmax(logits[:, ctx - 1:-1], -1).gather(-1, responses[..., None]).squeeze(-1)
    rm = response_mask.float()
    scores = torch.tensor([0.5, -0.3])
    last = response_mask.sum(1) - 1
    rewards = -0.05 * logprobs * rm  # KL-style per-token term (ref == policy here, kept for shape)
    rewards[torch.arange(2), last] += scores
    gamma, lam = 1.0, 0.95
    adv, lastgaelam = torch.zeros_like(rewards), torch.zeros(2)
    for t in reversed(range(rewards.shape[1])):  # loop over response steps, as TRL's compute_advantages
        nextv = values[:, t + 1] * rm[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros(2)
        delta = rewards[:, t] + gamma * nextv - values[:, t]
        lastgaelam = (delta + gamma * lam * lastgaelam) * rm[:, t]
        adv[:, t] = lastgaelam
    returns = adv + values
    assert torch.isfinite(returns).all()
    print("advantages", [round(x, 3) for x in adv[0].tolist()])


if __name__ == "__main__":
    main()
