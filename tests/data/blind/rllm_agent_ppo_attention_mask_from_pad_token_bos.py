"""rLLM AgentPPOTrainer: the trajectory attention_mask is `input_ids != pad_token_id` after pad := bos.

Citation: rllm-org/rllm#238 ("v0.2 masking/parsing fix", merged), commit a29b48ca ("fix masking/parsing
issue"); it rolls back the pad-token change of rllm-org/rllm#226. I read the diff of a29b48ca
(rllm/trainer/verl/agent_ppo_trainer.py, rllm/parser/utils.py, chat_template_parser.py).

Bug: fix_pad_token() replaced a pad_token equal to eos_token by the unk token, else by the BOS token. For a
tokenizer without unk whose pad is its eos (as I understand it, the DeepSeek-R1-Distill-Qwen family that
DeepseekQwenChatTemplateParser serves) the pad becomes BOS, which DeepseekQwenChatTemplateParser.parse puts
at the start of every first message. generate_agent_trajectory then built
attention_mask = torch.where(trajectory_batch != pad_token_id, 1, 0): the BOS of every prompt is masked out
as a key for the whole trajectory (and position_ids shift by one) in the actor/ref/critic forwards.

Fix: drop fix_pad_token and build the mask from the pre-padding lengths: prompt_pos >= max_prompt_length -
prompt_length for the left-padded prompts, resp_pos < response_length for the right-padded responses.

This program: the tokenizer fix-up, the parser, the trainer's batch assembly (verl's pad_sequence_to_length)
and a Qwen2-style actor (RoPE from position_ids, HF-style additive 4-D mask into
F.scaled_dot_product_attention) computing old log-probs.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Tokenizer:
    """DeepSeek-R1-Distill-Qwen-like special tokens: pad is eos, no unk."""

    def __init__(self):
        self.vocab = {"<bos>": 1, "<eos>": 2, "<User>": 3, "<Assistant>": 4, "<think>": 5}
        self.bos_token, self.eos_token, self.unk_token = "<bos>", "<eos>", None
        self.pad_token = self.eos_token

    @property
    def pad_token_id(self):
        return self.vocab[self.pad_token]

    @property
    def eos_token_id(self):
        return self.vocab[self.eos_token]

    def encode(self, pieces):
        return [self.vocab[p] if isinstance(p, str) else p for p in pieces]


def fix_pad_token(tokenizer):
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        if tokenizer.unk_token is not None and tokenizer.unk_token != tokenizer.eos_token:
            tokenizer.pad_token = tokenizer.unk_token
        elif tokenizer.bos_token is not None and tokenizer.bos_token != tokenizer.eos_token:
            tokenizer.pad_token = tokenizer.bos_token
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


class DeepseekQwenChatTemplateParser:
    def __init__(self, tokenizer):
        self.bos_token = tokenizer.bos_token
        self.eos_token = tokenizer.eos_token
        self.user_token = "<User>"
        self.assistant_token = "<Assistant>"
        self.generation_prompt = [self.assistant_token, "<think>"]

    def parse(self, messages, add_generation_prompt=False, is_first_msg=False):
        result = []
        if is_first_msg:
            result.append(self.bos_token)
        for message in messages:
            if message["role"] == "user":
                result += [self.user_token] + message["content"]
            else:
                result += [self.assistant_token] + message["content"] + [self.eos_token]
        if add_generation_prompt:
            result += self.generation_prompt
        return result


def pad_sequence_to_length(tensors, max_seq_len, pad_token_id, left_pad=False):
    if tensors.shape[-1] >= max_seq_len:
        return tensors
    pad_tuple = (max_seq_len - tensors.shape[-1], 0) if left_pad else (0, max_seq_len - tensors.shape[-1])
    return F.pad(tensors, pad_tuple, "constant", pad_token_id)


class DataConfig:
    max_prompt_length = 8
    max_response_length = 5


class AgentPPOTrainer:
    def __init__(self, tokenizer, data_config):
        self.tokenizer = tokenizer
        self.data_config = data_config

    def _transform_agent_trajectories(self, trajectories):
        all_initial_tokens_list = [t["prompt_tokens"] for t in trajectories]
        all_response_tokens_list = [t["response_tokens"] for t in trajectories]
        max_prompt_length = self.data_config.max_prompt_length
        max_response_length = self.data_config.max_response_length
        prompts_batch = torch.nn.utils.rnn.pad_sequence(
            [torch.flip(i, dims=[0]) for i in all_initial_tokens_list],
            batch_first=True, padding_value=self.tokenizer.pad_token_id).flip(dims=[1])
        prompts_batch = pad_sequence_to_length(prompts_batch, max_prompt_length, self.tokenizer.pad_token_id,
                                               left_pad=True)
        response_batch = torch.nn.utils.rnn.pad_sequence(
            all_response_tokens_list, batch_first=True, padding_value=self.tokenizer.pad_token_id)
        response_batch = pad_sequence_to_length(response_batch, max_response_length, self.tokenizer.pad_token_id,
                                                left_pad=False)
        trajectory_batch = torch.concat([prompts_batch, response_batch], dim=1)
        if FIXED:
            prompt_lengths = torch.as_tensor([len(t) for t in all_initial_tokens_list]).clamp_(
                min=0, max=max_prompt_length)
            prompt_pos = torch.arange(max_prompt_length).unsqueeze(0)
            prompt_mask = prompt_pos >= (max_prompt_length - prompt_lengths.unsqueeze(1))
            response_lengths = torch.as_tensor([len(t) for t in all_response_tokens_list]).clamp_(
                min=0, max=max_response_length)
            resp_pos = torch.arange(max_response_length).unsqueeze(0)
            response_mask = resp_pos < response_lengths.unsqueeze(1)
            attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
        else:
            attention_mask = torch.where(trajectory_batch != self.tokenizer.pad_token_id, 1, 0)
        position_ids = (torch.cumsum(attention_mask, dim=1) - 1) * attention_mask
        return {"input_ids": trajectory_batch, "attention_mask": attention_mask, "position_ids": position_ids}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen2Attention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        freqs = position_ids[:, None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(Qwen2Attention(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        min_value = torch.finfo(h.dtype).min
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask_4d = torch.zeros(keep.shape, dtype=h.dtype).masked_fill(~keep, min_value)
        for layer in self.layers:
            h = h + layer(h, mask_4d, position_ids)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    tokenizer = Tokenizer()
    if not FIXED:
        fix_pad_token(tokenizer)
    parser = DeepseekQwenChatTemplateParser(tokenizer)
    questions = [[20, 21, 22], [23, 24]]
    answers = [[30, 31, "<eos>"], [32, 33, 34, "<eos>"]]
    trajectories = []
    for q, a in zip(questions, answers):
        prompt = parser.parse([{"role": "user", "content": q}], add_generation_prompt=True, is_first_msg=True)
        trajectories.append({"prompt_tokens": torch.tensor(tokenizer.encode(prompt)),
                             "response_tokens": torch.tensor(tokenizer.encode(a))})
    batch = AgentPPOTrainer(tokenizer, DataConfig())._transform_agent_trajectories(trajectories)
    actor = Qwen2ForCausalLM()
    with torch.no_grad():
        logits = actor(**batch)
    responses = batch["input_ids"][:, DataConfig.max_prompt_length:]
    log_probs = logits[:, DataConfig.max_prompt_length - 1:-1].log_softmax(-1)
    old_log_prob = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    print("attention_mask", batch["attention_mask"].tolist())
    print("old_log_prob[:, 0]", [round(x, 4) for x in old_log_prob[:, 0].tolist()])


if __name__ == "__main__":
    main()
