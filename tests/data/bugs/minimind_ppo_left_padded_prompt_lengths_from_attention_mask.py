"""MiniMind PPO: the response mask of a left-padded batch starts at each prompt's unpadded length.

Citation: jingyaogong/minimind commit 9c98cab ("[fix] prompt length calculate"), with its follow-up
d7f4f4e ("[fix] ppo mask", issue jingyaogong/minimind#541); trainer/train_ppo.py, ppo_train_epoch.

The bug: the prompts are tokenized with `tokenizer.padding_side = 'left'`, then
`prompt_lengths = enc.attention_mask.sum(dim=1)`, the number of real prompt tokens. In a left-padded
row the prompt ends at column P (the padded width), not at prompt_lengths[i], so
`resp_mask = arange(seq_len) >= prompt_lengths` switches on inside the prompt: the actor's, the old
actor's and the reference's summed log-probs (and the response text sent to the reward) take in the
tail of every shorter prompt. The critic's value is read at `full_mask.sum(dim=1) - 1`, a count of
the row's real tokens, which in a left-padded row is not the column of its last real token.

The fix: 9c98cab sets every prompt length to the padded width, `torch.full((B,), P)`; d7f4f4e reads
the value at the column of the last real token,
`(full_mask * torch.arange(full_mask.size(1))).argmax(dim=1)`.

Ported from trainer/train_ppo.py at 9c98cab^ / d7f4f4e: CriticModel, calculate_rewards (the rule
rewards of `--reasoning 1`; the InternLM reward model is not built here, its score is left out),
ppo_train_epoch (generate, masks, actor / old actor / reference log-probs, clipped sequence-level
PPO loss, value loss, KL to the reference). MiniMind's own model is stood in for by a tiny
Qwen2ForCausalLM (same layout: model.model, model.model.norm, lm_head); the tokenizer is a tiny
word-level one carrying MiniMind's special tokens (pad `<|endoftext|>`, eos `<|im_end|>`).
"""

import copy
import re
import sys

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from torch.nn.utils import clip_grad_norm_
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv


class args:
    device = "cpu"
    max_seq_len = 66
    max_gen_len = 10
    clip_epsilon = 0.1
    vf_coef = 0.5
    kl_coef = 0.02
    grad_clip = 1.0
    accumulation_steps = 1
    update_old_actor_freq = 4
    reasoning = 1


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("user assistant system what is two plus three four times minus one how many legs does a cat "
         "have please answer briefly <think> </think> <answer> </answer> five six seven eight so").split()


def build_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="so"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")


# 自定义的Critic模型，继承自MiniMindLM
class CriticModel(Qwen2ForCausalLM):
    def __init__(self, params):
        super().__init__(params)
        # 替换lm_head为输出单一价值的线性层
        self.value_head = nn.Linear(params.hidden_size, 1)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = self.model.norm(outputs[0])
        values = self.value_head(hidden_states).squeeze(-1)
        return values


def calculate_rewards(prompts, responses):
    """整合所有奖励函数计算总奖励"""
    def reasoning_model_reward(rewards):
        pattern = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
        pattern2 = r"^<think>\n.*?\n</think>\n\n<answer>\n.*?\n</answer>$"
        matches_pattern = [re.match(pattern, response, re.S) for response in responses]
        matches_pattern2 = [re.match(pattern2, response, re.S) for response in responses]
        format_rewards = []
        for match_pattern, match_pattern2 in zip(matches_pattern, matches_pattern2):
            if match_pattern or match_pattern2:
                format_rewards.append(0.5)
            else:
                format_rewards.append(0.0)
        rewards += torch.tensor(format_rewards, device=args.device)

        def mark_num(text):
            reward = 0
            if text.count("<think>") == 1:
                reward += 0.25
            if text.count("</think>") == 1:
                reward += 0.25
            if text.count("<answer>") == 1:
                reward += 0.25
            if text.count("</answer>") == 1:
                reward += 0.25
            return reward

        mark_rewards = [mark_num(response) for response in responses]
        rewards += torch.tensor(mark_rewards, device=args.device)
        return rewards

    rewards = torch.zeros(len(responses), device=args.device)
    if args.reasoning == 1:
        rewards = reasoning_model_reward(rewards)
    return rewards


def ppo_train_step(step, prompts, tokenizer, actor_model, old_actor_model, ref_model, critic_model, actor_optimizer, critic_optimizer):
    actor_model.train()
    critic_model.train()
    enc = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=args.max_seq_len).to(args.device)
    if not FIXED:
        prompt_lengths = enc.attention_mask.sum(dim=1)  # [B]
    else:
        prompt_lengths = torch.full((enc.input_ids.size(0),), enc.input_ids.shape[1], dtype=torch.long, device=enc.input_ids.device)  # [B]

    with torch.no_grad():
        torch.manual_seed(1000 + step)
        gen_out = actor_model.generate(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask,
            max_new_tokens=args.max_gen_len, do_sample=True, temperature=0.8,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # [B, P+R]

    responses_text = [tokenizer.decode(gen_out[i, prompt_lengths[i]:], skip_special_tokens=True) for i in range(len(prompts))]
    rewards = calculate_rewards(prompts, responses_text)  # [B]

    full_mask = (gen_out != tokenizer.pad_token_id).long()  # [B, P+R]
    values_seq = critic_model(input_ids=gen_out, attention_mask=full_mask)  # [B, P+R]
    if not FIXED:
        last_indices = full_mask.sum(dim=1) - 1  # [B]
    else:
        last_indices = (full_mask * torch.arange(full_mask.size(1), device=gen_out.device)).argmax(dim=1)
    values = values_seq[torch.arange(values_seq.size(0), device=values_seq.device), last_indices]  # [B]
    advantages = rewards - values.detach()  # [B]

    logits = actor_model(input_ids=gen_out, attention_mask=full_mask).logits  # [B, P+R, V]
    labels = gen_out[:, 1:].clone()  # [B, P+R-1]
    logp_tokens = F.log_softmax(logits[:, :-1], dim=-1).gather(2, labels.unsqueeze(-1)).squeeze(-1)  # [B, P+R-1]
    seq_len = gen_out.size(1) - 1
    resp_mask = torch.arange(seq_len, device=gen_out.device).unsqueeze(0) >= prompt_lengths.unsqueeze(1)
    final_mask = resp_mask & (~labels.eq(tokenizer.pad_token_id))  # [B, P+R-1]
    actor_logp = (logp_tokens * final_mask).sum(dim=1)  # [B]

    with torch.no_grad():
        old_logits = old_actor_model(input_ids=gen_out, attention_mask=full_mask).logits
        old_logp_tokens = F.log_softmax(old_logits[:, :-1], dim=-1).gather(2, labels.unsqueeze(-1)).squeeze(-1)
        old_logp = (old_logp_tokens * final_mask).sum(dim=1)

        ref_logits = ref_model(input_ids=gen_out, attention_mask=full_mask).logits
        ref_logp_tokens = F.log_softmax(ref_logits[:, :-1], dim=-1).gather(2, labels.unsqueeze(-1)).squeeze(-1)
        ref_logp = (ref_logp_tokens * final_mask).sum(dim=1)

    kl = (actor_logp - old_logp).mean()
    kl_ref = (actor_logp - ref_logp).mean()
    ratio = torch.exp(actor_logp - old_logp)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1.0 - args.clip_epsilon, 1.0 + args.clip_epsilon) * advantages
    policy_loss = -torch.min(surr1, surr2).mean()
    value_loss = F.mse_loss(values, rewards)
    loss = policy_loss + args.vf_coef * value_loss + args.kl_coef * kl_ref
    loss.backward()

    if (step + 1) % args.accumulation_steps == 0:
        clip_grad_norm_(actor_model.parameters(), args.grad_clip)
        clip_grad_norm_(critic_model.parameters(), args.grad_clip)
        actor_optimizer.step()
        critic_optimizer.step()
        actor_optimizer.zero_grad()
        critic_optimizer.zero_grad()

    print(f"Step: {step}, Actor Loss: {policy_loss.item():.6f}, Critic Loss: {value_loss.item():.6f}, "
          f"Reward: {rewards.mean().item():.4f}, KL: {kl.item():.6f}, KL_ref: {kl_ref.item():.6f}, "
          f"actor_logp: {[round(v, 4) for v in actor_logp.tolist()]}")


def main():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"  # PPO需要左侧padding
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    actor_model = Qwen2ForCausalLM(config)
    old_actor_model = copy.deepcopy(actor_model).eval().requires_grad_(False)
    ref_model = copy.deepcopy(actor_model).eval().requires_grad_(False)
    critic_model = CriticModel(config)
    critic_model.load_state_dict(actor_model.state_dict(), strict=False)
    actor_optimizer = torch.optim.AdamW(actor_model.parameters(), lr=1e-3)
    critic_optimizer = torch.optim.AdamW(critic_model.parameters(), lr=1e-3)

    prompts = [
        "<|im_start|>user what is two plus three <|im_end|> <|im_start|>assistant",
        "<|im_start|>user how many legs does a cat have please answer briefly <|im_end|> <|im_start|>assistant",
        "<|im_start|>user what is four times two minus one please answer briefly <|im_end|> <|im_start|>assistant",
    ]
    for step in range(1, 4):
        ppo_train_step(step, prompts, tokenizer, actor_model, old_actor_model, ref_model, critic_model, actor_optimizer, critic_optimizer)


if __name__ == "__main__":
    main()
